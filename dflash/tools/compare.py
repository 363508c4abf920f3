"""Every batch order x layout on the same target, data and token budget, side by side.

One process (or one DeepSpeed launch) loads the target once and builds, for each mode, a
`Trainer` whose drafter starts from the same seed. The modes then take their optimizer steps
round-robin (step i of every mode, then step i + 1, ...), so drift of the machine (thermal,
other jobs) hits them alike.

Throughput (`measure_throughput`): every mode trains on the SAME random subset of the training
split (`--subset-tokens`), planned by the mode itself, so each is timed on a fair sample of the
epoch's lengths: a few steps of a whole sorted or bucketed epoch would hold only a few lengths.
Epoch 0 of the subset gives `warmup` steps, left out; epoch 1 is timed whole. The steps give real
and computed tokens/s (sums over steps, so long steps weigh as they cost), padding efficiency (on
the subset, and planned over the whole split beside it), the spread of step times across steps
and across ranks, each mode's ratio to sorted-padded (the seed's batching), and with
--time-phases the share of time in target forward, drafter, loss and optimizer.
`measure_sequentially` does the same one mode at a time, under a deadline (the GPU check).

Convergence (`measure_convergence`): each mode trains on the same number of real tokens; loss
and offline tau on the held-out split are recorded against tokens seen and training seconds,
for several seeds.

The results are plain dicts; `dflash.tools.compare_report` turns them into tables and charts.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import time
from pathlib import Path

import numpy as np

from dflash.data.planner import LAYOUTS, ORDERS
from dflash.errors import UserError
from dflash.training.config import TrainConfig
from dflash.training.data import held_out_split
from dflash.training.trainer import Trainer

MODES = tuple(f"{o}-{lay}" for o in ORDERS for lay in LAYOUTS)
BASELINE = "sorted-padded"
COST = "+cost"  # a mode planned with cost-balanced dealing (--balance), e.g. shuffle-packed+cost


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()] if text else list(MODES)
    bad = [m for m in modes if m.removesuffix(COST) not in MODES]
    if bad or not modes:
        raise UserError(f"--modes: unknown mode(s) {', '.join(bad) or '(none)'}; choose from {', '.join(MODES)}, "
                        f"each optionally with {COST} (cost-balanced dealing to the ranks)")
    return modes


class ModeRun:
    """One mode's trainer, driven one optimizer step per `step()` call through its own step."""

    def __init__(self, mode: str, trainer: Trainer):
        self.mode, self.trainer = mode, trainer
        self.records: list[dict] = []
        self.tokens_seen = 0
        self.train_seconds = 0.0
        self.measured_from = 0  # records before this index are the warm-up

    def step(self, origin: float) -> dict:
        """One optimizer step; the record is the same on every rank."""
        start = time.perf_counter()
        record = self.trainer.train_step()  # a record every step: the runs are built with log_every=1
        record = {"index": len(self.records), "start": start - origin, "seconds": record["step_seconds"], **record}
        self.tokens_seen += record["real_tokens"]
        self.train_seconds += record["seconds"]
        record.update(tokens_seen=self.tokens_seen, train_seconds=self.train_seconds)
        self.records.append(record)
        return record

    def warmup_steps(self, warmup: int) -> int:
        """Warm-up steps in epoch 0, at most all of it: the measured pass is epoch 1, whole."""
        return min(warmup, len(self.trainer.data.steps[0]))

    def start_measuring(self) -> None:
        """Leave the warm-up epoch for the first step of epoch 1, from which every step is measured."""
        if self.trainer.data.planner.epoch == 0:
            self.trainer.skip_to_epoch(1)
        self.measured_from = len(self.records)

    @property
    def measured(self) -> list[dict]:
        return self.records[self.measured_from:]


def build_run(cfg: TrainConfig, mode: str, out: Path, max_steps: int, target=None, *,
              time_micro_batches: bool = True) -> ModeRun:
    """A mode's trainer; `target` (a LoadedTarget) is shared, or loaded when None. With
    `time_micro_batches` every micro-batch is timed (a device sync after each) for the cost model."""
    order, layout = mode.removesuffix(COST).split("-")
    mode_cfg = cfg.replace(order=order, layout=layout, output_dir=str(out / f"seed{cfg.run.seed}" / mode),
                                   max_steps=max_steps, export=False, progress=False, resume=False, overwrite=True,
                                   stop_at_step=0, log_every=1, balance=mode.endswith(COST),
                                   time_micro_batches=time_micro_batches)
    return ModeRun(mode, Trainer(mode_cfg, target=target))


def _shared_data(cfg: TrainConfig, trainer: Trainer) -> TrainConfig:
    """cfg reading the data the first trainer prepared (a JSONL file is prepared once, for all modes)."""
    return cfg.replace(data=str(trainer.data.store_path))


def build_runs(cfg: TrainConfig, modes: list[str], out: Path, max_steps: int, say) -> list[ModeRun]:
    """A trainer per mode, all sharing one loaded target and one token store."""
    runs, target = [], None
    for mode in modes:
        runs.append(build_run(cfg, mode, out, max_steps, target))
        if target is None:
            target = runs[0].trainer.models.target
            cfg = _shared_data(cfg, runs[0].trainer)
    say(f"built {len(runs)} modes: {', '.join(modes)}")
    return runs


def run_interleaved(runs: list[ModeRun], done, origin: float, say=None) -> None:
    """Step the modes round-robin until `done(run)` holds for every one; `say` hears each round."""
    active = [r for r in runs if not done(r)]
    while active:
        for run in active:
            run.step(origin)
        if say:
            say("  " + ", ".join(f"{r.mode} step {len(r.records)}: {r.records[-1]['seconds']:.2f}s" for r in active))
        active = [r for r in active if not done(r)]


def _length_stats(lengths) -> dict:
    lengths = np.asarray(lengths)
    return {"samples": int(lengths.size), "tokens": int(lengths.sum()), "mean": float(lengths.mean()),
            **{f"p{q}": float(np.percentile(lengths, q)) for q in (10, 50, 90)}, "max": int(lengths.max())}


def _phase_shares(measured: list[dict]) -> dict | None:
    """Each phase's share of the measured steps' device time, and the seconds (summed over steps)."""
    if not measured or "phase_seconds" not in measured[0]:
        return None
    seconds = {p: float(sum(r["phase_seconds"][p] for r in measured)) for p in measured[0]["phase_seconds"]}
    total = sum(seconds.values())
    return {"seconds": seconds, "shares": {p: t / total if total > 0 else 0.0 for p, t in seconds.items()}}


def summarize_throughput(measured: list[dict], warmup: int) -> dict:
    """Throughput statistics of one mode's measured steps (`warmup` steps before them left out)."""
    if not measured:
        raise UserError("no measured steps: raise --steps")
    seconds = np.array([r["seconds"] for r in measured])
    real = sum(r["real_tokens"] for r in measured)
    computed = sum(r["computed_tokens"] for r in measured)
    rank_s = np.array([r["rank_seconds"] for r in measured])
    rank_work = np.array([r["rank_computed_tokens"] for r in measured], dtype=np.float64)
    busy = np.array([r["rank_busy_seconds"] for r in measured])
    waited = np.array([r["rank_wait_seconds"] for r in measured])
    stats = {
        "tokens_per_s": real / seconds.sum(),
        "computed_tokens_per_s": computed / seconds.sum(),
        "efficiency": real / computed,
        "steps": len(measured), "warmup_steps": warmup, "real_tokens": real, "computed_tokens": computed,
        "micro_batches_per_step": float(np.mean([r["micro_batches"] for r in measured])),
        "step_seconds_median": float(np.median(seconds)),
        # spread across steps: coefficient of variation and the range
        "step_seconds_cv": float(seconds.std() / seconds.mean()),
        "step_seconds_min": float(seconds.min()), "step_seconds_max": float(seconds.max()),
        # spread across ranks, per step then averaged: (slowest - fastest) / mean of the ranks' busy
        # seconds (before the step's barrier; collectives inside the step make ranks wait there too)
        "rank_seconds_spread": float(np.mean((busy.max(1) - busy.min(1)) / busy.mean(1))),
        "rank_work_imbalance": float(np.mean(rank_work.max(1) / rank_work.mean(1))),
        # time the ranks spent waiting for the slowest one at the steps' collectives, as a share of
        # all ranks' step time, and each rank's totals
        "wait_fraction": float(waited.sum() / (rank_s.shape[1] * seconds.sum())),
        "rank_busy_seconds": busy.sum(0).tolist(), "rank_wait_seconds": waited.sum(0).tolist(),
    }
    phases = _phase_shares(measured)
    if phases:
        stats["phases"] = phases
    return stats


def _split_lengths(run: ModeRun) -> np.ndarray:
    """Lengths of the whole training split the subset was drawn from."""
    d, cfg = run.trainer.data, run.trainer.cfg
    return d.store.lengths[held_out_split(len(d.store), cfg.inputs.eval_fraction, cfg.run.seed)[0]]


def epoch_efficiency(run: ModeRun) -> float:
    """The padding efficiency of this mode's plan of the WHOLE training split (the measured subset is
    smaller: sorted and bucketed orders find fewer close lengths in it, so pad more)."""
    from dflash.data.plan_stats import plan_stats
    from dflash.data.planner import plan_batches

    d, cfg = run.trainer.data, run.trainer.cfg
    lengths = _split_lengths(run)
    config = dataclasses.replace(d.planner.config, boundaries=cfg.batches.boundaries, balance=False, row_budget=None)
    batches = [b for rank in plan_batches(lengths, config) for b in rank]
    return plan_stats(lengths, batches, config.layout, config.token_budget)["efficiency"]


def mode_result(run: ModeRun) -> dict:
    """A mode's statistics over its measured pass, what it saw beside the split it was drawn from,
    and whether the pass was whole (every sample of the subset) or cut short by a deadline."""
    d = run.trainer.data
    seen = d.store.lengths[d.train_idx]
    stats = summarize_throughput(run.measured, run.measured_from)
    stats.update(complete=run.trainer.done and stats["real_tokens"] == int(seen.sum()),
                 lengths_seen=_length_stats(seen), lengths_split=_length_stats(_split_lengths(run)),
                 epoch_efficiency=epoch_efficiency(run))
    return {**stats, "steps_log": run.records}


def _subset_config(cfg: TrainConfig, steps: int) -> TrainConfig:
    """Every mode trains on one random subset of the split (about `steps` packed steps of tokens, or
    --subset-tokens): epoch 0 for the warm-up, epoch 1 measured whole."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return cfg.replace(subset_tokens=cfg.inputs.subset_tokens or steps * cfg.batches.step_tokens * world_size,
                               epochs=2, max_steps=0)


def measure_throughput(cfg: TrainConfig, modes: list[str], out: Path, *, steps: int, warmup: int, say) -> dict:
    """`{mode: statistics}` of each mode's pass over the same random samples, after `warmup` steps.

    Every mode trains on one random subset of the training split holding about `steps` packed steps
    of tokens (`--subset-tokens`), planned by the mode: the same samples and real tokens for all, a
    fair sample of the epoch's lengths whatever the order. Epoch 0 of the subset gives the warm-up
    steps; epoch 1 is measured whole. The modes step interleaved."""
    runs = build_runs(_subset_config(cfg, steps), modes, out, max_steps=0, say=say)
    seen = runs[0].trainer.data.store.lengths[runs[0].trainer.data.train_idx]
    say(f"throughput: every mode trains on the same {seen.size:,} samples ({int(seen.sum()):,} tokens, a random "
        f"subset of the split): {warmup} warm-up step(s), then one whole pass, measured; interleaved")
    origin = time.perf_counter()
    run_interleaved(runs, lambda r: len(r.records) >= r.warmup_steps(warmup), origin, say)
    for r in runs:
        r.start_measuring()
    run_interleaved(runs, lambda r: r.trainer.done, origin, say)
    result = {r.mode: mode_result(r) for r in runs}
    add_ratios(result)
    report_calibration(calibrate(runs), out, say)
    return result


def add_ratios(result: dict) -> None:
    """Each mode's tokens/s as a ratio to sorted-padded's, where that was measured."""
    base = result.get(BASELINE)
    if base is None or "tokens_per_s" not in base:
        return
    for stats in result.values():
        if "tokens_per_s" in stats:
            stats["ratio_to_sorted_padded"] = stats["tokens_per_s"] / base["tokens_per_s"]
            stats["computed_ratio_to_sorted_padded"] = stats["computed_tokens_per_s"] / base["computed_tokens_per_s"]


def measure_sequentially(cfg: TrainConfig, modes: list[str], out: Path, *, steps: int, warmup: int, say,
                         deadline: float | None = None, on_result=None, keep_going: bool = False,
                         target=None) -> dict:
    """As `measure_throughput`, one mode after the other, each freed before the next is built (one
    drafter and optimizer in memory at a time; the target is loaded once, or is `target`, a
    LoadedTarget shared with the caller): for a time-capped check.

    Once built, each mode gets an equal share of the time left to `deadline` (time.monotonic()) for
    its warm-up and pass; a pass cut short is kept, marked `complete: False` (at least one step is
    measured), and modes with no time left are recorded as skipped. On CUDA each mode's
    `peak_memory_mib` is its own (the peak is reset before it is built).
    `on_result(result)` hears the result after every mode. With `keep_going`, a mode that fails
    is recorded as `{"error": ...}` and the next one still runs."""
    cfg, result = _subset_config(cfg, steps), {}
    for i, mode in enumerate(modes):
        if deadline is not None and time.monotonic() >= deadline:
            result[mode] = {"skipped": "out of time"}
            continue
        run = None
        free_memory()
        try:
            run = build_run(cfg, mode, out, 0, target, time_micro_batches=False)  # no syncs inside the step
            target, cfg = run.trainer.models.target, _shared_data(cfg, run.trainer)
            # an equal share of what is left once built (the first build may also load the target)
            share = None if deadline is None else (deadline - time.monotonic()) / (len(modes) - i)
            _measure_one(run, warmup, None if share is None else time.monotonic() + share, say)
            result[mode] = mode_result(run)
            peaks = [r["peak_memory_mib"] for r in run.records if "peak_memory_mib" in r]
            if peaks:  # the most this mode allocated (built, warm-up and pass): one mode in memory at a time
                result[mode]["peak_memory_mib"] = max(peaks)
        except Exception as err:
            if not keep_going:
                raise
            import traceback

            traceback.print_exc()
            result[mode] = {"error": f"{type(err).__name__}: {err}"[:1000]}
        finally:
            if run is not None:
                run.trainer.close()
            del run
        add_ratios(result)
        if on_result:
            on_result(result)
    free_memory()
    return result


def free_memory() -> None:
    """Free what a finished run left (reference cycles, the CUDA cache) and start CUDA's peak afresh,
    so that the next run's `torch.cuda.max_memory_allocated` (its records' `peak_memory_mib`) is its own."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _measure_one(run: ModeRun, warmup: int, deadline: float | None, say) -> None:
    origin = time.perf_counter()
    while len(run.records) < run.warmup_steps(warmup):
        run.step(origin)
    run.start_measuring()
    # at least one measured step, whatever the deadline says
    while not run.trainer.done and (not run.measured or deadline is None or time.monotonic() < deadline):
        record = run.step(origin)
        say(f"  {run.mode} step {len(run.records)}: {record['seconds']:.2f}s, {record['real_tokens']:,} tokens")


def calibrate(runs: list[ModeRun]) -> dict:
    """Fit the cost model to every measured micro-batch of every mode and rank (after the warm-up).

    Two fits: the FLOP model of the target and drafter sizes scaled by one factor, plus per-sample
    and per-micro-batch overheads ("flops_scaled"), and all seven coefficients free, non-negative
    ("least_squares"). Each reports R^2 and the median relative error on the micro-batches it was fit on.
    """
    from dflash.data.cost import fit

    rows = np.array([row for r in runs for rec in r.measured for row in rec.get("micro_batch_costs", [])])
    if len(rows) < 3:
        return {"measurements": len(rows)}
    features, seconds = rows[:, :-1], rows[:, -1]
    scaled, scaled_quality = fit(features, seconds, prior=runs[0].trainer.data.flop_model)
    free, free_quality = fit(features, seconds, window=runs[0].trainer.data.flop_model.window)
    return {"measurements": len(rows), "flops_scaled": {**scaled_quality, "model": scaled.to_dict()},
            "least_squares": {**free_quality, "model": free.to_dict()}}


def report_calibration(calibration: dict, out: Path, say) -> None:
    """Say how well the cost model predicts the measured micro-batch times; on rank 0 write
    calibration.json and cost_model.json (the free fit, for --balance --cost-model)."""
    import torch.distributed as dist

    if "least_squares" not in calibration:
        say(f"cost model: only {calibration['measurements']} timed micro-batches, no calibration")
        return
    for name in ("flops_scaled", "least_squares"):
        fit = calibration[name]
        say(f"cost model, {name}: R^2 {fit['r2']:.3f}, median error {fit['median_rel_error']:.1%} over "
            f"{fit['measurements']} micro-batches")
    if dist.get_rank() == 0:
        (out / "calibration.json").write_text(json.dumps(calibration, indent=1) + "\n")
        (out / "cost_model.json").write_text(json.dumps(calibration["least_squares"]["model"], indent=1) + "\n")
        say(f"wrote {out / 'calibration.json'} and {out / 'cost_model.json'}")


def _evaluate(runs: list[ModeRun], evals: dict) -> None:
    """Held-out metrics of every run, appended to `evals[mode]` with the tokens and time so far."""
    for r in runs:
        e = r.trainer.evaluate()
        if e is not None:
            evals[r.mode].append({"step": len(r.records), "tokens_seen": r.tokens_seen,
                                  "train_seconds": r.train_seconds, "loss": e["loss"], "tau": e["tau"]})


def _until(budget: int, goal: dict):
    """A run is done once it has seen `budget` real tokens or reached its goal step."""
    return lambda r: r.tokens_seen >= budget or len(r.records) >= goal[r.mode]


def measure_convergence(cfg: TrainConfig, modes: list[str], out: Path, *, steps: int, repeats: int,
                        eval_every: int, say) -> dict:
    """Loss and held-out tau against real tokens and training seconds, per mode and seed.

    Every mode trains on the same real-token budget: the fewest tokens any mode's plan holds in
    `steps` steps (modes stop at the first step that reaches it; the schedule spans `steps`).
    """
    result = {m: {"repeats": []} for m in modes}
    for rep in range(repeats):
        seed_cfg = cfg.replace(seed=cfg.run.seed + rep)
        runs = build_runs(seed_cfg, modes, out, max_steps=steps, say=say)
        cfg = cfg.replace(data=str(runs[0].trainer.data.store_path))
        budget = min(sum(r.trainer.data.step_tokens()[:steps]) for r in runs)
        evals = {r.mode: [] for r in runs}
        say(f"convergence, seed {seed_cfg.run.seed}: {budget:,} real tokens per mode, interleaved")
        _evaluate(runs, evals)
        origin, active = time.perf_counter(), list(runs)
        while active:
            goal = {r.mode: len(r.records) + eval_every for r in active}
            run_interleaved(active, _until(budget, goal), origin, say)
            _evaluate(active, evals)
            active = [r for r in active if r.tokens_seen < budget]
        for r in runs:
            result[r.mode]["repeats"].append({
                "seed": seed_cfg.run.seed, "budget_tokens": budget,
                "train": [{k: s[k] for k in ("index", "tokens_seen", "train_seconds", "loss", "anchor_tau")}
                          for s in r.records],
                "eval": evals[r.mode]})
        del runs
        gc.collect()
    for stats in result.values():
        finals = [rep["eval"][-1] for rep in stats["repeats"] if rep["eval"]]
        stats["final_eval_loss_mean"] = float(np.mean([f["loss"] for f in finals]))
        stats["final_eval_loss_std"] = float(np.std([f["loss"] for f in finals]))
        stats["final_eval_tau_mean"] = float(np.mean([f["tau"] for f in finals]))
        stats["final_eval_tau_std"] = float(np.std([f["tau"] for f in finals]))
        stats["train_seconds_mean"] = float(np.mean([rep["train"][-1]["train_seconds"] for rep in stats["repeats"]]))
    return result
