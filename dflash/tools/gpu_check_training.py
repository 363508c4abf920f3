"""The training stages of the one-shot GPU check (launch/gpu_check.py): drafter training steps on a
random Qwen3-8B-shaped target (the demo target's tiny shape for the dry run), loaded once for all.
  e2e      three batching modes on the same samples: tokens/s, phase shares, peak memory
  memory   the memory plan's peak against the measured one at two row budgets
  kinds    every other drafter kind's steps on e2e's samples, beside DFlash's tokens/s
Each takes (OUT, the check's shapes, its deadline) and writes OUT/<stage>.json through `Report`,
the JSON writer of the check's other stages too."""
from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from pathlib import Path

DEMO_TARGET = Path(__file__).resolve().parents[1] / "demo" / "assets" / "target"


class Report:
    """One stage's JSON file, rewritten (atomically) at every update."""

    def __init__(self, path: Path, **fields):
        self.path, self.data = path, dict(fields)
        self.save()

    def update(self, **fields):
        self.data.update(fields)
        self.save()

    def save(self):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


E2E_MODES = ("sorted-padded", "shuffle-packed", "bucketed-packed")
DEFAULT_MODE = "shuffle-packed"  # the trainer's default order and layout: the memory and kinds stages train it
MEMORY_STEPS = 2  # the first allocates the optimizer's state and ZeRO's buckets; the second runs with them


def e2e_options(dry_run: bool) -> tuple[list[str], int]:
    """Training options of the end-to-end stage and its measured steps' worth of tokens: the
    trainer's defaults (the paper's recipe: 512 anchors, block 16, 5 drafter layers, 16,384-token
    micro-batches, 4 per step) on Qwen3-8B; for the dry run the demo target's tiny shape."""
    if dry_run:
        target = f"random:{DEMO_TARGET}"
        return ["--target", target, "--data", "random:300", "--token-budget", "512", "--num-anchors", "8",
                "--draft-layers", "1", "--num-target-features", "2", "--num-workers", "0"], 2
    return ["--target", "random:qwen3-8b", "--data", "random"], 4


def training_config(dry_run: bool, runs: Path, *extra: str):
    """The training stages' TrainConfig: `e2e_options` with `extra` flags, the runs in `runs`, one
    rank on this machine (its GPU, or the CPU)."""
    import torch

    from dflash.distributed.ranks import single_process_env
    from dflash.training.config import load_config

    single_process_env(os.environ, min(torch.cuda.device_count(), 1))
    options, _ = e2e_options(dry_run)
    return load_config([*options, *extra, "--output-dir", str(runs), "--time-phases", "--no-progress"])


_TARGETS: dict[tuple, object] = {}  # by the options that shape it: the training stages load it once


def shared_target(train_cfg):
    """The target of `train_cfg`, loaded by the first training stage that needs it (a Qwen3-8B one is
    16 GB: one copy for all), on the device and in the precision its trainers plan with."""
    import torch

    from dflash.devices import resolve_dtype
    from dflash.distributed.process_group import init_distributed
    from dflash.target.spec import load_target_spec
    from dflash.training.data import chat_data
    from dflash.training.models import load_train_target

    d, dev = train_cfg.drafter, train_cfg.device
    key = (train_cfg.inputs.target, d.target_layer_ids, d.num_target_features, d.mask_token, dev.attention_backend,
           dev.dtype)
    if key not in _TARGETS:
        init_distributed()
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        _TARGETS[key] = load_train_target(load_target_spec(train_cfg.inputs.target), device,
                                          resolve_dtype(dev.dtype, device), d, dev, chat_data(train_cfg.inputs))
    return _TARGETS[key]


def recipe(train_cfg) -> tuple[dict, bool]:
    """The recipe a run of `train_cfg` trains with (the options a recipe sets, those
    `launch/compare_recipes.py` varies: the loss's and the optimizer's) and whether it is the
    default one, what a run gets without recipe flags (the slot-weighted cross-entropy, AdamW at
    6e-4, warm-up and cosine, clipping at 1)."""
    from dflash.tools.recipes import RECIPE_FIELDS
    from dflash.training.config import TrainConfig, resolve

    default = resolve(TrainConfig.of(block_size=train_cfg.drafter.block_size))  # the loss decay follows the block
    values = {name: train_cfg.value(name) for name in RECIPE_FIELDS}
    return values, values == {name: default.value(name) for name in RECIPE_FIELDS}


def stage_e2e(out: Path, cfg: dict, deadline: float) -> bool:
    """Drafter training steps of the default recipe on a random Qwen3-8B-shaped target, three
    batching modes on the same samples (`dflash.tools.compare.measure_sequentially`), one after the
    other; OUT/e2e.json is rewritten after each mode. Our kernels run their pinned configs
    (DFLASH_PIN_CONFIGS=1): no autotuning inside a timed pass. Passes when every mode was measured,
    with the default recipe."""
    from dflash.tools import compare
    from dflash.tools.compare_report import throughput_table

    options, steps = e2e_options(cfg["dry_run"])
    runs = out / "e2e_runs"
    train_cfg = training_config(cfg["dry_run"], runs)
    values, default = recipe(train_cfg)
    report = Report(out / "e2e.json", options=options, measured_steps=steps, warmup_steps=1, modes=list(E2E_MODES),
                    kernel_configs="pinned (DFLASH_PIN_CONFIGS=1)", recipe=values, recipe_is_default=default,
                    results={},
                    method="every mode trains on the same random subset of the split (about `measured_steps` steps "
                           "of tokens), planned by the mode: a warm-up step, then one whole pass, timed; the "
                           "learning-rate schedule spans these steps")

    def record(result):
        report.update(results=result)
        print(throughput_table(result), flush=True)

    # no time left: nothing is loaded (measure_sequentially records every mode as skipped)
    target = shared_target(train_cfg) if time.monotonic() < deadline else None
    with pinned_configs():
        result = compare.measure_sequentially(train_cfg, list(E2E_MODES), runs, steps=steps, warmup=1,
                                              say=lambda text: print(text, flush=True), deadline=deadline,
                                              on_result=record, keep_going=True, target=target)
    ok = default and all("tokens_per_s" in result.get(mode, {}) for mode in E2E_MODES)
    report.update(results=result, passed=ok)
    return ok


@contextlib.contextmanager
def pinned_configs():
    """DFLASH_PIN_CONFIGS=1 inside: our kernels run their pinned configs (no autotuning inside a
    timed step, nor its benchmark buffers inside a measured peak); the caller's setting after."""
    before = os.environ.get("DFLASH_PIN_CONFIGS")
    os.environ["DFLASH_PIN_CONFIGS"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("DFLASH_PIN_CONFIGS")
        else:
            os.environ["DFLASH_PIN_CONFIGS"] = before


def memory_budgets(train_cfg) -> dict[str, int]:
    """The row budgets the memory stage sets the plan against the measurement at: one sample's
    blocks per micro-batch (block size x anchors, the least a row budget may be) and the planner's
    own (0: the most rows that fit the device by the plan, the default run's; no cap on the CPU)."""
    return {"one-sample": train_cfg.drafter.block_size * train_cfg.drafter.num_anchors, "planned": 0}


def measure_memory_at(train_cfg, target, runs: Path, deadline: float) -> dict:
    """MEMORY_STEPS steps of `train_cfg` (at least one, fewer when the deadline comes) against its
    memory plan: the plan's peak for the dearest micro-batch that ran, and at the budgets, beside
    the measured peak: torch.cuda.max_memory_allocated on a GPU (reset before the trainer is built;
    the target is already there, as in a run), on the CPU the tensor bytes alive after every op
    (`TensorBytes`, as launch/measure_memory.py; the target's, loaded before, added)."""
    import torch

    from dflash.distributed.partition import target_bytes
    from dflash.sizing.tensor_bytes import TensorBytes
    from dflash.tools import compare

    cuda = torch.cuda.is_available()
    compare.free_memory()  # resets CUDA's peak too
    before = torch.cuda.memory_allocated() if cuda else None
    shapes, steps = [], 0
    with contextlib.nullcontext() if cuda else TensorBytes() as counter:
        trainer = compare.build_run(train_cfg, DEFAULT_MODE, runs, MEMORY_STEPS, target,
                                    time_micro_batches=False).trainer
        try:
            while not trainer.done and (not steps or time.monotonic() < deadline):
                trainer.train_step()
                shapes.extend(trainer.micro_batch_shapes)
                steps += 1
        finally:
            trainer.close()
    if cuda:
        measured = torch.cuda.max_memory_allocated()
    else:
        loaded = target_bytes(target.model)
        measured = counter.peak + loaded["resident"] + loaded["shared"]
    plan, b = trainer.memory_plan, trainer.cfg.batches
    tokens, rows, row_keys = max(shapes, key=lambda shape: plan.peak(*shape)["total"])
    items = plan.peak(tokens, rows, row_keys)
    entry = {"row_budget": b.row_budget, "token_budget": b.token_budget, "step_tokens": b.step_tokens,
             "steps": steps, "micro_batches": len(shapes), "most_rows": max(s[1] for s in shapes),
             "dearest_micro_batch": {"tokens": tokens, "rows": rows, "row_keys": row_keys},
             "estimate_bytes": items["total"], "estimate_items": items, "measured_bytes": measured,
             "ratio": measured / items["total"]}
    if b.row_budget:  # the plan at the budgets themselves: the most a micro-batch may need
        entry["estimate_at_budgets_bytes"] = plan.peak(b.token_budget, b.row_budget)["total"]
    if before is not None:  # allocated when the trainer was built: the target, and anything left over
        entry["allocated_before_bytes"] = before
    return entry


def stage_memory(out: Path, cfg: dict, deadline: float) -> bool:
    """The memory plan (`dflash.sizing.memory`) against the measured peak of training steps at two
    row budgets (`memory_budgets`), the default recipe and mode on the e2e stage's target and data,
    one step a micro-batch's worth of tokens; OUT/memory.json is rewritten after each budget, the
    ratio measured / estimate is what a first run on a GPU calibrates the plan by, and the
    difference between the budgets (`between_budgets`) that of the micro-batches' part alone. Passes
    when both budgets were measured."""
    import torch

    from dflash.sizing.memory import gib

    runs = out / "memory_runs"
    base = training_config(cfg["dry_run"], runs)
    # micro-batches of several samples, so that the planner's own budget holds several samples' rows:
    # e2e's 16,384 tokens on the GPU; 4 x 512 on the dry run, whose samples are cut at 512 tokens
    tokens = base.batches.token_budget * (4 if cfg["dry_run"] else 1)
    budgets = memory_budgets(base)
    values, default = recipe(base)
    cuda = torch.cuda.is_available()
    report = Report(out / "memory.json", options=e2e_options(cfg["dry_run"])[0], mode=DEFAULT_MODE,
                    recipe=values, recipe_is_default=default, steps_per_budget=MEMORY_STEPS,
                    measured_by="torch.cuda.max_memory_allocated (reset per budget)" if cuda else
                    "tensor bytes alive after every op (TensorBytes, as launch/measure_memory.py) plus the target's",
                    estimate="the memory plan's peak (tensors, no reserve) for the dearest micro-batch that ran",
                    budgets={})
    for name, row_budget in budgets.items():
        if time.monotonic() >= deadline:
            report.data["budgets"][name] = {"skipped": "out of time"}
            report.save()
            continue
        train_cfg = base.replace(row_budget=row_budget, token_budget=tokens, step_tokens=tokens)
        try:
            with pinned_configs():
                entry = measure_memory_at(train_cfg, shared_target(train_cfg), runs / name, deadline)
            print(f"memory {name}: row budget {entry['row_budget']:,}, dearest micro-batch "
                  f"{entry['dearest_micro_batch']['rows']:,} rows: measured {gib(entry['measured_bytes'])}, plan "
                  f"{gib(entry['estimate_bytes'])} (ratio {entry['ratio']:.3f})", flush=True)
        except Exception as err:  # recorded: the other budget still runs
            traceback.print_exc()
            entry = {"error": f"{type(err).__name__}: {err}"[:1000]}
        report.data["budgets"][name] = entry
        report.save()
    measured = report.data["budgets"]
    ok = all("ratio" in measured.get(name, {}) for name in budgets)
    if ok:  # the static part is the same at both: the difference is the micro-batches' part alone
        tight, planned = (measured[name] for name in budgets)
        extra = {k: planned[k] - tight[k] for k in ("measured_bytes", "estimate_bytes")}
        report.data["between_budgets"] = {**extra, "ratio": extra["measured_bytes"] / extra["estimate_bytes"]
                                          if extra["estimate_bytes"] else None}
    report.update(passed=ok)
    return ok


def stage_kinds(out: Path, cfg: dict, deadline: float) -> bool:
    """Every drafter kind but DFlash (`dflash.drafter.kinds`), one after the other: `kind_steps`. Passes
    when every kind's did."""
    from dflash.drafter.kinds import DEFAULT, all_kinds

    return all([kind_steps(kind.name, out, cfg, deadline) for kind in all_kinds() if kind.name != DEFAULT])


def small_drafter(train_cfg, folder: Path) -> Path:
    """A new drafter of `train_cfg`'s kind and layers on its target, with the kind's small settings
    (`DrafterKind.small_settings`), saved in `folder` for --init-drafter: the dry run's tiny target
    trains it in a second where a kind's released sizes are Qwen3-8B's (a 1024-wide head over the demo
    target's 128 took 25 s a step on a CPU, 0.4 s at its small sizes)."""
    import torch

    from dflash.drafter.kinds import drafter_kind
    from dflash.training.models import new_drafter

    target, d = shared_target(train_cfg), train_cfg.drafter
    kind = drafter_kind(d.drafter_kind)
    settings = kind.small_settings(target.hf.config.get_text_config().hidden_size, target.model.num_embedding_rows)
    torch.manual_seed(train_cfg.run.seed)
    new_drafter(target, kind, settings, block_size=d.block_size, draft_layers=d.draft_layers,
                layer_types=d.drafter_layer_types, sliding_window=d.sliding_window).save_pretrained(folder)
    return folder


def kind_steps(kind: str, out: Path, cfg: dict, deadline: float) -> bool:
    """Training steps of a drafter of `kind` (`--drafter-kind`, sized as released; the dry run's at its
    small sizes, `small_drafter`) in the default recipe and mode on the e2e stage's target and samples
    (the same subset: its DFlash shuffle-packed pass is the one to compare with, `ratio_to_dflash`), a
    warm-up step then the pass, cut at the deadline; tokens/s, step time and peak memory in
    OUT/<kind>.json. Passes when a step was measured."""
    from dflash.tools import compare

    options, steps = e2e_options(cfg["dry_run"])
    runs = out / f"{kind}_runs"
    train_cfg = training_config(cfg["dry_run"], runs, "--drafter-kind", kind)
    if cfg["dry_run"] and time.monotonic() < deadline:  # the kind's small sizes: see `small_drafter`
        init = small_drafter(train_cfg, runs / "small_drafter")
        train_cfg = training_config(True, runs, "--drafter-kind", kind, "--init-drafter", str(init))
        options = [*options, "--init-drafter", str(init)]
    values, default = recipe(train_cfg)
    d = train_cfg.drafter
    report = Report(out / f"{kind}.json", options=[*options, "--drafter-kind", kind],
                    drafter_kind=d.drafter_kind, drafter_layer_types=d.drafter_layer_types,
                    sliding_window=d.sliding_window, recipe=values, recipe_is_default=default, mode=DEFAULT_MODE,
                    measured_steps=steps, warmup_steps=1, kernel_configs="pinned (DFLASH_PIN_CONFIGS=1)", results={})
    target = shared_target(train_cfg) if time.monotonic() < deadline else None
    with pinned_configs():
        result = compare.measure_sequentially(train_cfg, [DEFAULT_MODE], runs, steps=steps, warmup=1,
                                              say=lambda text: print(text, flush=True), deadline=deadline,
                                              keep_going=True, target=target)
    mine = result[DEFAULT_MODE]
    e2e = out / "e2e.json"
    dflash = json.loads(e2e.read_text())["results"].get(DEFAULT_MODE, {}) if e2e.exists() else {}
    if "tokens_per_s" in mine and "tokens_per_s" in dflash:
        mine["ratio_to_dflash"] = mine["tokens_per_s"] / dflash["tokens_per_s"]
    ok = "tokens_per_s" in mine
    report.update(results=result, passed=ok)
    if ok:
        peak = f", peak {mine['peak_memory_mib']:,.0f} MiB" if "peak_memory_mib" in mine else ""
        ratio = f", {mine['ratio_to_dflash']:.2f}x DFlash's tokens/s" if "ratio_to_dflash" in mine else ""
        print(f"{kind} {DEFAULT_MODE}: {mine['tokens_per_s']:,.0f} tokens/s, median step "
              f"{mine['step_seconds_median']:.2f} s{peak}{ratio}", flush=True)
    return ok
