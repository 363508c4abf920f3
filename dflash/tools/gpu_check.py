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
  fused_ops    OUT/fused_ops.json: the fused drafter ops at Qwen3-8B's sizes (bf16): the block convolution
               (65,536 rows x 4,096, groups 16, kernel 2) and the frozen head with in-kernel top-16
               (1,024 x 151,936 logits, softcap), first and second call against the fp32 reference, and
               forward / backward times against the torch paths (dflash/tools/gpu_check_fused_ops.py).
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
  kinds        OUT/<kind>.json for every drafter kind but DFlash: its training steps (`--drafter-kind`,
               sized as released), the default recipe and mode on e2e's target and samples:
               tokens/s (and the ratio to DFlash's shuffle-packed pass), step times, peak memory.
The training stages (dflash/tools/gpu_check_training.py) share one target, loaded by the first of
them; each has seconds of its own (--e2e-seconds, --memory-seconds, --kinds-seconds, and the ops
stage --fused-ops-seconds), kept free
of the stages before it, and what its deadline leaves unmeasured is recorded as skipped.

    bash launch/gpu_check.sh OUT                 # what the GPU machine runs
    python3 launch/gpu_check.py OUT --dry-run    # tiny shapes on the CPU (Triton interpreter), seconds
"""
from __future__ import annotations

import argparse
import os
import platform
import site as site_module
import sys
import time
import traceback
import zipfile
from pathlib import Path

from dflash.options import number
from dflash.tools.gpu_check_fused_ops import stage_fused_ops
from dflash.tools.gpu_check_training import Report, stage_e2e, stage_kinds, stage_memory

ROOT = Path(__file__).resolve().parents[2]  # the repository: wheels/ beside launch/
BUDGET_S = 450  # for the stages; gpu_check.sh stops everything at 480 s (8 minutes)
# kept for each stage after the kernel benchmark: every stage stops the seconds kept for those after it
# before the budget's end (the correctness and kernel stages at 450 - 330 = 120 s)
E2E_S = 200
MEMORY_S = 40
KINDS_S = 50
FUSED_OPS_S = 40


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder for the JSON files (created)")
    p.add_argument("--stages", default=",".join(STAGE_NAMES), help=f"comma-separated, of {', '.join(STAGE_NAMES)}")
    p.add_argument("--budget", type=number(float, minimum=0), default=BUDGET_S,
                   help="seconds for all stages; the benchmark stops measuring when it runs out")
    for stage, seconds in (("fused_ops", FUSED_OPS_S), ("e2e", E2E_S), ("memory", MEMORY_S), ("kinds", KINDS_S)):
        p.add_argument(f"--{stage.replace('_', '-')}-seconds", type=number(float, minimum=0), default=seconds,
                       help=f"seconds of the budget kept for the {stage} stage (the stages before it stop earlier)")
    p.add_argument("--wheels", type=Path, default=ROOT / "wheels",
                   help="folder of wheels carried in for what the image lacks (DeepSpeed and its dependencies)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU through the Triton interpreter (what CI runs); the kernel "
                        "benchmark times one call per method, without a warm-up call")
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


def shapes(dry_run: bool) -> dict:
    """Qwen3-8B attention shapes on the GPU; tiny ones for the dry run. `length_scale` scales the
    seed-like sample lengths: the dry run's shrink with the longest sample (8,192 -> 64), not with
    the tokens (1/768: 27 samples of 1-7 tokens, each its own tiles, seconds apiece in the Triton
    interpreter), so that its 64 tokens hold a handful of samples of a few to tens of tokens."""
    if dry_run:
        return {"tokens": 64, "heads": 2, "kv_heads": 1, "head_dim": 32, "block_size": 4, "blocks": 8,
                "dtype": "float32", "max_len": 48, "length_scale": 1 / 128, "patterns": ("seed-like",),
                "dry_run": True, "window": 8}
    # window: a drafter's sliding layers (the Qwen3.6 recipe's 2,048) for the block-sliding check
    return {"tokens": 49152, "heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16, "blocks": 4096,
            "dtype": "bfloat16", "max_len": 8192, "length_scale": 1.0, "patterns": ("seed-like", "bimodal"),
            "dry_run": False, "window": 2048}


def seed_like_batch(cfg: dict, seed: int = 0) -> list[int]:
    """Sample lengths drawn from the seed-like distribution until they fill cfg["tokens"] (the last
    one cut), scaled by cfg["length_scale"] (down for the dry run)."""
    from dflash.data import seed_like_lengths

    scale = cfg["length_scale"]
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
    if time allows; whatever the deadline leaves unmeasured is recorded as skipped. The dry run
    times each method's first call on the shuffled lengths only, without the warm-up call (it shows
    the benchmark runs)."""
    import numpy as np
    import torch

    from dflash.data import seed_like_lengths
    from dflash.tools import bench_kernels

    bench_cfg = {k: cfg[k] for k in ("tokens", "heads", "kv_heads", "head_dim", "block_size", "blocks",
                                     "length_scale")}
    bench_kernels.run_benchmark(bench_cfg, cfg["patterns"], np.asarray(seed_like_lengths(100_000)),
                                cfg["max_len"], out / "bench_kernels.json", repeats=5 if torch.cuda.is_available()
                                else 1, dtype=getattr(torch, cfg["dtype"]), deadline=deadline,
                                warmup=not cfg["dry_run"],  # the interpreter compiles and autotunes nothing
                                orders=("shuffled",) if cfg["dry_run"] else ("sorted", "shuffled"))
    return True


# The stages in order, each with the deadline main() gives it.
STAGES = {"correctness": stage_correctness, "kernels": stage_kernels, "fused_ops": stage_fused_ops, "e2e": stage_e2e,
          "memory": stage_memory, "kinds": stage_kinds}
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
    kept = {"fused_ops": args.fused_ops_seconds, "e2e": args.e2e_seconds, "memory": args.memory_seconds,
            "kinds": args.kinds_seconds}
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
