"""One-shot GPU check of the attention kernels and a training step, made for a lent GPU machine
(one H200, the image's python3 with torch and Triton, no install, no network), in at most 8 minutes.

Stages, each writing its JSON into OUT as it goes (a run cut short keeps what it measured):
  env          OUT/env.json: versions, GPU, what was carried in (wheels/)
  correctness  OUT/correctness.json: Qwen3-8B attention shapes (bf16, 32 query / 8 KV heads,
               head dim 128, seed-like lengths packed to a 49,152-token micro-batch, DFlash blocks
               of 16): our kernels' first call (the one that autotunes on a GPU) and second call,
               atomic and deterministic dQ, against an fp32 per-sample reference; deterministic
               mode repeated bitwise; torch varlen and FlexAttention checked the same way; the
               block kernels also as a drafter's sliding layer (window 2,048, causal in the block).
  kernels      OUT/bench_kernels.json: TFLOP/s, forward and forward+backward, ours (atomic and
               deterministic) vs torch varlen (FlashAttention-2 inside torch), padded SDPA and
               FlexAttention, seed-like lengths sorted and shuffled (launch/bench_kernels.py).
  e2e          OUT/e2e.json: end to end, drafter training steps of the default recipe (`recipe`:
               the slot-weighted cross-entropy, AdamW; DeepSpeed ZeRO-2, bf16) on a randomly
               initialised Qwen3-8B-shaped target (`--target random:qwen3-8b`, synthetic seed-like
               data: nothing downloaded), tokens/s for sorted-padded, shuffle-packed and
               bucketed-packed, each timed on the SAME random samples of the epoch (planned by the
               mode, one whole pass after a warm-up step), with the share of device time in target
               forward, drafter forward + backward, loss and optimizer, and each mode's peak memory.
               The JSON is rewritten after every mode. DeepSpeed, absent from the image, comes as
               wheels in wheels/.
  memory       OUT/memory.json: the memory plan against the measured peak, a few steps (the
               default recipe and mode, on e2e's target and data) at two row budgets: one sample's
               blocks per micro-batch and the plan's own; per budget the plan's peak for the
               dearest micro-batch that ran, torch.cuda.max_memory_allocated (reset per budget; on
               the CPU the tensor bytes counted after every op) and their ratio, what the first run
               on a GPU calibrates the plan by. Rewritten after each budget.
  dflash2      OUT/dflash2.json: DFlash2 drafter training steps (`--drafter-kind dflash2`, sized as
               released), the default recipe and mode on e2e's target and samples: tokens/s (and
               the ratio to DFlash's shuffle-packed pass), step times, peak memory.
The training stages share one target, loaded by the first of them; each has seconds of its own
(--e2e-seconds, --memory-seconds, --dflash2-seconds), kept free of the stages before it, and what
its deadline leaves unmeasured is recorded as skipped.

    bash launch/gpu_check.sh OUT                 # what the GPU machine runs
    python3 launch/gpu_check.py OUT --dry-run    # tiny shapes on the CPU (Triton interpreter), seconds
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import site as site_module
import sys
import time
import traceback
import zipfile
from pathlib import Path

from dflash.options import number

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 450  # for the stages; gpu_check.sh stops everything at 480 s (8 minutes)
# kept for each training stage: every stage stops the seconds kept for those after it before the
# budget's end (the correctness and kernel stages at 450 - 290 = 160 s)
E2E_S = 200
MEMORY_S = 40
DFLASH2_S = 50


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder for the JSON files (created)")
    p.add_argument("--stages", default=",".join(STAGE_NAMES), help=f"comma-separated, of {', '.join(STAGE_NAMES)}")
    p.add_argument("--budget", type=number(float, minimum=0), default=BUDGET_S,
                   help="seconds for all stages; the benchmark stops measuring when it runs out")
    for stage, seconds in (("e2e", E2E_S), ("memory", MEMORY_S), ("dflash2", DFLASH2_S)):
        p.add_argument(f"--{stage}-seconds", type=number(float, minimum=0), default=seconds,
                       help=f"seconds of the budget kept for the {stage} stage (the stages before it stop earlier)")
    p.add_argument("--wheels", type=Path, default=ROOT / "wheels",
                   help="folder of wheels carried in for what the image lacks (DeepSpeed and its dependencies)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU through the Triton interpreter (what CI runs)")
    return p.parse_args(argv)


def use_carried_wheels(folder: Path) -> tuple[list[str], list[str]]:
    """Put the packages carried in as wheels (folder/*.whl, made by `pip download` on a machine with
    a network: docs/BENCHMARKS.md) on the path: each wheel this interpreter can run (its tags) is
    unpacked once into folder/site-<interpreter> (a wheel is a zip of its installed files), which
    becomes a site directory (its .pth files are read too), first on the path: the carried set was
    resolved together, and it may hold newer versions of what the image has (pydantic 2.14 needs
    typing_extensions >= 4.16). Returns the wheels used and those skipped (built for another Python)."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    supported = set(sys_tags())
    used, skipped = [], []
    for wheel in sorted(folder.glob("*.whl")):
        (used if parse_wheel_filename(wheel.name)[3] & supported else skipped).append(wheel)
    if not used:
        return [], [w.name for w in skipped]
    site = folder / f"site-{sys.implementation.cache_tag}"
    for wheel in used:
        done = site / f".{wheel.name}.unpacked"
        if not done.exists():
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
            done.touch()
    site_module.addsitedir(str(site))
    sys.path.remove(str(site))
    sys.path.insert(0, str(site))
    return [w.name for w in used], [w.name for w in skipped]


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


def shapes(dry_run: bool) -> dict:
    """Qwen3-8B attention shapes on the GPU; tiny ones for the dry run."""
    if dry_run:
        return {"tokens": 64, "heads": 2, "kv_heads": 1, "head_dim": 32, "block_size": 4, "blocks": 8,
                "dtype": "float32", "max_len": 48, "patterns": ("seed-like",), "dry_run": True, "window": 8}
    # window: a drafter's sliding layers (the Qwen3.6 recipe's 2,048) for the block-sliding check
    return {"tokens": 49152, "heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16, "blocks": 4096,
            "dtype": "bfloat16", "max_len": 8192, "patterns": ("seed-like", "bimodal"), "dry_run": False,
            "window": 2048}


def seed_like_batch(cfg: dict, seed: int = 0) -> list[int]:
    """Sample lengths drawn from the seed-like distribution until they fill cfg["tokens"] (the last
    one cut), scaled down with the tokens for the dry run."""
    from dflash.data import seed_like_lengths

    scale = cfg["tokens"] / 49152
    lengths, pool = [], seed_like_lengths(10_000, seed=seed)
    for n in pool:
        lengths.append(max(1, min(int(n * scale), cfg["max_len"])))
        if sum(lengths) >= cfg["tokens"]:
            break
    lengths[-1] -= sum(lengths) - cfg["tokens"]
    return [n for n in lengths if n > 0]


def _rel_rms(x, ref) -> float:
    ref = ref.float()
    return ((x.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-2)).item()


def stage_correctness(out: Path, cfg: dict, deadline: float) -> bool:
    """Our kernels at cfg's shapes against the fp32 per-sample reference: every output and gradient
    within tolerance on the first call (autotuning, on a GPU) and the second, atomic and
    deterministic; deterministic bitwise equal across two calls; the library backends too."""
    import numpy as np
    import torch

    from dflash.ops import dflash_block_attention, varlen_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, cfg["dtype"])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3  # relative RMS error (tests/ops floors; TF32 on CUDA)
    lengths = seed_like_batch(cfg)
    g = torch.Generator(device="cpu").manual_seed(0)
    t, hq, hkv, d, b = sum(lengths), cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["block_size"]
    cu_cpu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    cu = cu_cpu.to(device)
    rng = np.random.default_rng(0)
    per = np.floor(cfg["blocks"] * np.asarray(lengths) / t).astype(int)
    per[np.argmax(lengths)] += cfg["blocks"] - per.sum()
    seq = np.repeat(np.arange(len(lengths)), per)
    anchor = (rng.random(len(seq)) * np.asarray(lengths)[seq]).astype(np.int64)
    seq_t, anchor_t = (torch.tensor(x, dtype=torch.int32, device=device) for x in (seq, anchor))
    rows = len(seq) * b

    def randn(n, h):
        return torch.randn(n, h, d, generator=g).to(device, dtype)

    ops = {
        "varlen": ((randn(t, hq), randn(t, hkv), randn(t, hkv)), randn(t, hq),
                   lambda x, backend, det=None: varlen_attention(*x, cu, max(lengths), backend=backend,
                                                                 cu_seqlens_cpu=cu_cpu, deterministic=det)),
        "block": ((randn(rows, hq), randn(t, hkv), randn(t, hkv), randn(rows, hkv), randn(rows, hkv)),
                  randn(rows, hq),
                  lambda x, backend, det=None: dflash_block_attention(*x, cu, seq_t, anchor_t, b, backend=backend,
                                                                      cu_seqlens_cpu=cu_cpu, deterministic=det)),
        # a sliding drafter layer: context limited to the window, causal inside the block
        "block-sliding": ((randn(rows, hq), randn(t, hkv), randn(t, hkv), randn(rows, hkv), randn(rows, hkv)),
                          randn(rows, hq),
                          lambda x, backend, det=None: dflash_block_attention(
                              *x, cu, seq_t, anchor_t, b, backend=backend, cu_seqlens_cpu=cu_cpu, deterministic=det,
                              window=cfg["window"], causal=True)),
    }
    report = Report(out / "correctness.json", shapes=cfg, samples=len(lengths), max_len=max(lengths),
                    block_rows=rows, tolerance_rel_rms=tol, reference="fp32, per sample (backend='torch')",
                    checks=[])
    ok = True

    def run(x, grad, fn, backend, det=None):
        leaves = [a.detach().requires_grad_() for a in x]
        o = fn(leaves, backend, det)
        grads = torch.autograd.grad(o, leaves, grad.to(o.dtype))
        return [o.detach(), *grads]

    for op, (x, grad, fn) in ops.items():
        names = ["out", "dq", "dk", "dv"] if op == "varlen" else ["out", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"]
        ref = run([a.float() for a in x], grad.float(), fn, "torch")
        cases = [("triton", "atomic", False, "first call"), ("triton", "atomic", False, "second call"),
                 ("triton", "deterministic", True, "first call"), ("triton", "deterministic", True, "second call")]
        libraries = ["torch_varlen", "flex"] if op == "varlen" else ["flex"]
        cases += [(lib, "library", None, "") for lib in libraries if device == "cuda"]
        previous = None
        for backend, mode, det, call in cases:
            if time.monotonic() > deadline:
                report.data["checks"].append({"op": op, "backend": backend, "skipped": "out of time"})
                report.save()
                continue
            entry = {"op": op, "backend": backend, "mode": mode, "call": call}
            started = time.monotonic()
            try:
                got = run(x, grad, fn, backend, det)
                errors = {n: _rel_rms(a, r) for n, a, r in zip(names, got, ref, strict=True)}
                entry.update(errors=errors, passed=all(e <= tol for e in errors.values()))
                if mode == "deterministic" and call == "second call":
                    entry["bitwise_equal_to_first_call"] = all(torch.equal(a, p) for a, p in
                                                               zip(got, previous, strict=True))
                    entry["passed"] = entry["passed"] and entry["bitwise_equal_to_first_call"]
                previous = got
            except Exception as err:  # recorded: the other checks still run
                entry.update(passed=False, error=f"{type(err).__name__}: {err}"[:500])
            entry["seconds"] = round(time.monotonic() - started, 2)
            ok = ok and entry["passed"]
            report.data["checks"].append(entry)
            report.update(passed=ok)
            print(f"correctness {op:6s} {backend:12s} {mode:13s} {call:11s} "
                  f"{'ok' if entry['passed'] else 'FAILED'} {entry.get('errors', entry.get('error'))}", flush=True)
        del ref
    return ok


def stage_kernels(out: Path, cfg: dict, deadline: float) -> bool:
    """launch/bench_kernels.py at cfg's shapes: seed-like lengths sorted and shuffled, then bimodal
    if time allows; whatever the deadline leaves unmeasured is recorded as skipped."""
    import bench_kernels  # launch/ is this script's folder, first on sys.path
    import numpy as np
    import torch

    from dflash.data import seed_like_lengths

    bench_cfg = {k: cfg[k] for k in ("tokens", "heads", "kv_heads", "head_dim", "block_size", "blocks")}
    bench_kernels.run_benchmark(bench_cfg, cfg["patterns"], np.asarray(seed_like_lengths(100_000)),
                                cfg["max_len"], out / "bench_kernels.json", repeats=5 if torch.cuda.is_available()
                                else 1, dtype=getattr(torch, cfg["dtype"]), deadline=deadline)
    return True


E2E_MODES = ("sorted-padded", "shuffle-packed", "bucketed-packed")
DEFAULT_MODE = "shuffle-packed"  # the trainer's default order and layout: the memory and DFlash2 stages train it
MEMORY_STEPS = 2  # the first allocates the optimizer's state and ZeRO's buckets; the second runs with them


def e2e_options(dry_run: bool) -> tuple[list[str], int]:
    """Training options of the end-to-end stage and its measured steps' worth of tokens: the
    trainer's defaults (the paper's recipe: 512 anchors, block 16, 5 drafter layers, 16,384-token
    micro-batches, 4 per step) on Qwen3-8B; for the dry run the demo target's tiny shape."""
    if dry_run:
        target = f"random:{ROOT / 'dflash' / 'demo' / 'assets' / 'target'}"
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
    from dflash.models.target_spec import load_target_spec
    from dflash.training.models import load_train_target

    d, dev = train_cfg.drafter, train_cfg.device
    key = (train_cfg.inputs.target, d.target_layer_ids, d.num_target_features, d.mask_token, dev.attention_backend,
           dev.dtype)
    if key not in _TARGETS:
        init_distributed()
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        _TARGETS[key] = load_train_target(train_cfg, load_target_spec(train_cfg.inputs.target), device,
                                          resolve_dtype(dev.dtype, device))
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
    from dflash.models.tensor_bytes import TensorBytes
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


def stage_dflash2(out: Path, cfg: dict, deadline: float) -> bool:
    """DFlash2 drafter training steps (`--drafter-kind dflash2`, sized as released) of the default
    recipe and mode on the e2e stage's target and samples (the same subset: its DFlash shuffle-packed
    pass is the one to compare with, `ratio_to_dflash`), a warm-up step then the pass, cut at the
    deadline; tokens/s, step time and peak memory in OUT/dflash2.json. Passes when a step was measured."""
    from dflash.tools import compare

    options, steps = e2e_options(cfg["dry_run"])
    runs = out / "dflash2_runs"
    train_cfg = training_config(cfg["dry_run"], runs, "--drafter-kind", "dflash2")
    values, default = recipe(train_cfg)
    d = train_cfg.drafter
    report = Report(out / "dflash2.json", options=[*options, "--drafter-kind", "dflash2"],
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
        print(f"dflash2 {DEFAULT_MODE}: {mine['tokens_per_s']:,.0f} tokens/s, median step "
              f"{mine['step_seconds_median']:.2f} s{peak}{ratio}", flush=True)
    return ok


# The stages in order, each with the deadline main() gives it.
STAGES = {"correctness": stage_correctness, "kernels": stage_kernels, "e2e": stage_e2e,
          "memory": stage_memory, "dflash2": stage_dflash2}
STAGE_NAMES = tuple(STAGES)


def environment(wheels: list[str]) -> dict:
    import torch
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda, "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
           "carried_wheels": wheels, "pinned_configs": os.environ.get("DFLASH_PIN_CONFIGS", "0")}
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(), capability=torch.cuda.get_device_capability())
    for name in ("transformers", "deepspeed", "flash_attn"):
        try:
            env[name] = __import__(name).__version__
        except Exception as err:  # absent on the image, or broken: say which
            env[name] = f"not importable ({type(err).__name__})"
    return env


def stage_deadline(name: str, stages: list[str], deadline: float, kept: dict[str, float]) -> float:
    """The last stage has the budget's end; every stage stops the seconds `kept` for the stages
    after it earlier, so that autotuning and compiles there cannot eat their time (a stage done
    early leaves its time to the next)."""
    return deadline - sum(kept.get(later, 0.0) for later in stages[stages.index(name) + 1:])


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    deadline = start + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed
    wheels, skipped = use_carried_wheels(args.wheels)
    if skipped:
        print(f"carried wheels for another Python, not used: {', '.join(skipped)}", flush=True)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        print(f"unknown stage(s) {unknown}; choose from {list(STAGES)}", file=sys.stderr)
        return 2
    Report(out / "env.json", **environment(wheels), carried_wheels_skipped=skipped)
    cfg = shapes(args.dry_run)
    kept = {"e2e": args.e2e_seconds, "memory": args.memory_seconds, "dflash2": args.dflash2_seconds}
    summary = Report(out / "summary.json", stages={}, budget_s=args.budget)
    ok = True
    for name in stages:
        began = time.monotonic()
        print(f"== {name} ({began - start:.0f} s in)", flush=True)
        try:
            passed = STAGES[name](out, cfg, stage_deadline(name, stages, deadline, kept))
        except Exception:  # a stage that breaks is recorded; the next still runs
            traceback.print_exc()
            passed = False
        ok = ok and passed
        summary.data["stages"][name] = {"passed": passed, "seconds": round(time.monotonic() - began, 1)}
        summary.update(total_s=round(time.monotonic() - start, 1))
    print(f"== done in {time.monotonic() - start:.0f} s: {'all passed' if ok else 'FAILURES'} "
          f"(see {out}/*.json)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
