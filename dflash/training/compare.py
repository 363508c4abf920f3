"""Every batch order x layout on the same target, data and token budget, side by side.

One process (or one DeepSpeed launch) loads the target once and builds, for each mode, a
`Trainer` whose drafter starts from the same seed. The modes then take their optimizer steps
round-robin (step i of every mode, then step i + 1, ...), so drift of the machine (thermal,
other jobs) hits them alike.

Throughput (`measure_throughput`): the first `warmup` steps of each mode are left out; the
rest give real and computed tokens/s (sums over steps, so long steps weigh as they cost),
padding efficiency, the spread of step times across steps and across ranks, and each mode's
ratio to sorted-padded (the seed's batching).

Convergence (`measure_convergence`): each mode trains on the same number of real tokens; loss
and offline tau on the held-out split are recorded against tokens seen and training seconds,
for several seeds.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import time
from pathlib import Path

import numpy as np

from dflash.data.planner import LAYOUTS, ORDERS
from dflash.errors import UserError
from dflash.training.config import TrainConfig
from dflash.training.trainer import Trainer

MODES = tuple(f"{o}-{lay}" for o in ORDERS for lay in LAYOUTS)
BASELINE = "sorted-padded"
SEED_SHUFFLE_PADDED_RATIO = 0.37  # the seed's padded full shuffle vs its sorted batches (2.7x slower)


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


def build_runs(cfg: TrainConfig, modes: list[str], out: Path, max_steps: int, say) -> list[ModeRun]:
    """A trainer per mode, all sharing one loaded target and one token store."""
    runs, target = [], None
    for mode in modes:
        order, layout = mode.removesuffix(COST).split("-")
        mode_cfg = dataclasses.replace(cfg, order=order, layout=layout, output_dir=str(out / f"seed{cfg.seed}" / mode),
                                       max_steps=max_steps, export=False, progress=False, resume=False, overwrite=True,
                                       stop_at_step=0, log_every=1, balance=cfg.balance or mode.endswith(COST),
                                       time_micro_batches=True)
        trainer = Trainer(mode_cfg, target=target)
        if target is None:
            target = trainer.models.target
            cfg = dataclasses.replace(cfg, data=str(trainer.data.store_path))  # prepared once, shared by the rest
        runs.append(ModeRun(mode, trainer))
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


def summarize_throughput(records: list[dict], warmup: int) -> dict:
    """Throughput statistics of one mode's steps after the warm-up."""
    measured = records[warmup:]
    if not measured:
        raise UserError(f"no steps left after {warmup} warm-up step(s); raise --steps or lower --warmup")
    seconds = np.array([r["seconds"] for r in measured])
    real = sum(r["real_tokens"] for r in measured)
    computed = sum(r["computed_tokens"] for r in measured)
    rank_s = np.array([r["rank_seconds"] for r in measured])
    rank_work = np.array([r["rank_computed_tokens"] for r in measured], dtype=np.float64)
    busy = np.array([r["rank_busy_seconds"] for r in measured])
    waited = np.array([r["rank_wait_seconds"] for r in measured])
    return {
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


def calibrate(runs: list[ModeRun], warmup: int) -> dict:
    """Fit the cost model to every measured micro-batch of every mode and rank (after the warm-up).

    Two fits: the FLOP model of the target and drafter sizes scaled by one factor, plus per-sample
    and per-micro-batch overheads ("flops_scaled"), and all seven coefficients free, non-negative
    ("least_squares"). Each reports R^2 and the median relative error on the micro-batches it was fit on.
    """
    from dflash.data.cost import fit

    rows = np.array([row for r in runs for rec in r.records[warmup:] for row in rec.get("micro_batch_costs", [])])
    if len(rows) < 3:
        return {"measurements": len(rows)}
    features, seconds = rows[:, :-1], rows[:, -1]
    scaled, scaled_quality = fit(features, seconds, prior=runs[0].trainer.data.flop_model)
    free, free_quality = fit(features, seconds, window=runs[0].trainer.data.flop_model.window)
    return {"measurements": len(rows), "flops_scaled": {**scaled_quality, "model": scaled.to_dict()},
            "least_squares": {**free_quality, "model": free.to_dict()}}


def measure_throughput(cfg: TrainConfig, modes: list[str], out: Path, *, steps: int, warmup: int, say) -> dict:
    """`{mode: statistics}` over `steps` measured steps per mode after `warmup`, plus the raw steps."""
    runs = build_runs(cfg, modes, out, max_steps=steps + warmup, say=say)
    available = min(r.trainer.data.total_steps for r in runs)
    if available < steps + warmup:
        raise UserError(f"--steps {steps} + --warmup {warmup}: the data gives only {available} steps in "
                        f"{cfg.epochs} epoch(s) for some mode; raise --epochs or lower --steps")
    say(f"throughput: {warmup} warm-up + {steps} measured steps per mode, interleaved")
    run_interleaved(runs, lambda r: len(r.records) >= steps + warmup, time.perf_counter(), say)
    result = {r.mode: {**summarize_throughput(r.records, warmup), "steps_log": r.records} for r in runs}
    if BASELINE in result:
        base = result[BASELINE]
        for stats in result.values():
            stats["ratio_to_sorted_padded"] = stats["tokens_per_s"] / base["tokens_per_s"]
            stats["computed_ratio_to_sorted_padded"] = stats["computed_tokens_per_s"] / base["computed_tokens_per_s"]
    report_calibration(calibrate(runs, warmup), out, say)
    return result


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
        seed_cfg = dataclasses.replace(cfg, seed=cfg.seed + rep)
        runs = build_runs(seed_cfg, modes, out, max_steps=steps, say=say)
        cfg = dataclasses.replace(cfg, data=str(runs[0].trainer.data.store_path))
        budget = min(sum(r.trainer.data.step_tokens()[:steps]) for r in runs)
        evals = {r.mode: [] for r in runs}
        say(f"convergence, seed {seed_cfg.seed}: {budget:,} real tokens per mode, interleaved")
        _evaluate(runs, evals)
        origin, active = time.perf_counter(), list(runs)
        while active:
            goal = {r.mode: len(r.records) + eval_every for r in active}
            run_interleaved(active, _until(budget, goal), origin, say)
            _evaluate(active, evals)
            active = [r for r in active if r.tokens_seen < budget]
        for r in runs:
            result[r.mode]["repeats"].append({
                "seed": seed_cfg.seed, "budget_tokens": budget,
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


# ---- reports -------------------------------------------------------------------------------
def throughput_table(result: dict) -> str:
    head = (f"{'mode':<22} {'tokens/s':>9} {'computed/s':>10} {'effic.':>7} {'ratio':>6} {'step s':>7} "
            f"{'step cv':>7} {'rank spread':>11} {'waiting':>7} {'mb/step':>7}")
    lines = [head, "-" * len(head)]
    for mode, s in result.items():
        lines.append(f"{mode:<22} {s['tokens_per_s']:>9,.0f} {s['computed_tokens_per_s']:>10,.0f} "
                     f"{s['efficiency']:>7.1%} {s.get('ratio_to_sorted_padded', float('nan')):>5.2f}x "
                     f"{s['step_seconds_median']:>7.3f} {s['step_seconds_cv']:>7.1%} {s['rank_seconds_spread']:>11.1%} "
                     f"{s['wait_fraction']:>7.1%} {s['micro_batches_per_step']:>7.1f}")
    notes = []
    if "shuffle-padded" in result and "ratio_to_sorted_padded" in result["shuffle-padded"]:
        notes.append(f"shuffle-padded: {result['shuffle-padded']['ratio_to_sorted_padded']:.2f}x sorted-padded "
                     f"(the seed measured {SEED_SHUFFLE_PADDED_RATIO:.2f}x)")
    if {"shuffle-packed", "sorted-packed"} <= result.keys():
        ratio = result['shuffle-packed']['tokens_per_s'] / result['sorted-packed']['tokens_per_s']
        notes.append(f"shuffle-packed: {ratio:.3f}x "
                     "sorted-packed")
    return "\n".join(lines + notes)


def convergence_table(result: dict) -> str:
    head = f"{'mode':<17} {'eval loss':>17} {'eval tau':>15} {'train s':>8} {'repeats':>7}"
    lines = [head, "-" * len(head)]
    for mode, s in result.items():
        lines.append(f"{mode:<17} {s['final_eval_loss_mean']:>8.4f} ± {s['final_eval_loss_std']:<6.4f} "
                     f"{s['final_eval_tau_mean']:>6.3f} ± {s['final_eval_tau_std']:<6.3f} "
                     f"{s['train_seconds_mean']:>8.1f} "
                     f"{len(s['repeats']):>7}")
    return "\n".join(lines)


def _colors(modes):
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    return {m: cmap(MODES.index(m.removesuffix(COST))) for m in modes}


def plot_throughput(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result)
    x = np.arange(len(modes))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    real = [result[m]["tokens_per_s"] for m in modes]
    ax.bar(x - 0.2, real, 0.4, label="real tokens/s")
    ax.bar(x + 0.2, [result[m]["computed_tokens_per_s"] for m in modes], 0.4, label="computed tokens/s", alpha=0.6)
    for i, m in enumerate(modes):
        if "ratio_to_sorted_padded" in result[m]:
            ax.text(i - 0.2, real[i], f"{result[m]['ratio_to_sorted_padded']:.2f}x", ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(x, modes, rotation=20)
    ax.set_ylabel("tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_convergence(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = _colors(result)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for mode, stats in result.items():
        for i, rep in enumerate(stats["repeats"]):
            label = mode if i == 0 else None
            for col, x in enumerate(("tokens_seen", "train_seconds")):
                color = colors[mode]
                axes[0, col].plot([s[x] for s in rep["train"]], [s["loss"] for s in rep["train"]], color=color,
                                  alpha=0.25, lw=0.8)
                axes[0, col].plot([e[x] for e in rep["eval"]], [e["loss"] for e in rep["eval"]], "o-", color=color,
                                  ms=3, lw=1.2, label=label)
                axes[1, col].plot([e[x] for e in rep["eval"]], [e["tau"] for e in rep["eval"]], "o-", color=color,
                                  ms=3, lw=1.2, label=label)
    for col, xlabel in enumerate(("real tokens seen", "training seconds")):
        axes[0, col].set(xlabel=xlabel, ylabel="loss (lines: eval; faint: train steps)")
        axes[1, col].set(xlabel=xlabel, ylabel="eval tau (offline acceptance length)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
