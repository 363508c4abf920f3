"""Benchmark dflash's Triton attention kernels against the public alternatives.

Causal varlen attention (the target's): ours vs padded SDPA and the library backends of
dflash.ops (FlexAttention with a document mask, torch.nn.attention.varlen (FlashAttention-2),
flash-attn's varlen function) where they run. DFlash block attention (the drafter's): ours vs
FlexAttention with the block mask (backend="flex"). Ours runs twice: dQ accumulated with
atomics (the default) and deterministic=True (dQ in a kernel of its own).
Length patterns (seed-like, constant, uniform, long-tail, bimodal), each sorted and shuffled,
packed to a real micro-batch (49,152 tokens). TFLOP/s count visible query-key pairs only
(forward 4*D per pair and head; forward+backward 3.5x that), for padded SDPA too (its padding
is work that counts for nothing). Only the op call is timed: what is built once per batch (our
tile lists, FlexAttention's block mask, the padded copies) is built by an untimed warm-up call.
The JSON is rewritten after every measurement: a run cut short keeps what it measured.
Our kernels' configs: autotuned (default), or pinned with DFLASH_PIN_CONFIGS=1 (the fastest
expected config that fits the GPU, no timing; deterministic=True always runs pinned configs).

On a machine without CUDA the kernels run in Triton's interpreter at a reduced size: that
proves the script works, the times mean nothing.

    python launch/bench_kernels.py --out runs/bench   # writes bench_kernels.json and .png
    python launch/bench_kernels.py --quick --lengths my_lengths.npy   # your own sample lengths (.npy)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from dflash.data import seed_like_lengths
from dflash.errors import UserError, exit_on_user_error
from dflash.ops import dflash_block_attention, varlen_attention
from dflash.ops.common.triton_utils import pin_configs
from dflash.options import number

PATTERNS = ("seed-like", "constant", "uniform", "long-tail", "bimodal")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_kernels", help="folder for bench_kernels.json and .png")
    p.add_argument("--quick", action="store_true", help="seed-like and bimodal only, fewer repeats")
    p.add_argument("--tokens", type=number(int, minimum=1), default=None,
                   help="tokens per call (default 49152; 256 on the CPU)")
    p.add_argument("--heads", type=number(int, minimum=1), default=None, help="query heads (default 32; 2 on the CPU)")
    p.add_argument("--kv-heads", type=number(int, minimum=1), default=None,
                   help="key/value heads (default 8; 1 on the CPU)")
    p.add_argument("--head-dim", type=number(int, minimum=1), default=None,
                   help="head dim (default 128; 32 on the CPU)")
    p.add_argument("--block-size", type=number(int, minimum=2), default=16, help="DFlash block size B")
    p.add_argument("--blocks", type=number(int, minimum=1), default=None,
                   help="DFlash blocks per call, spread over the samples by length (default 4096; 16 on the CPU)")
    p.add_argument("--max-len", type=number(int, minimum=1), default=8192,
                   help="longest sample (scaled down on the CPU)")
    p.add_argument("--repeats", type=number(int, minimum=1), default=None, help="timed calls per measurement (median)")
    p.add_argument("--lengths", metavar="F.npy", default=None,
                   help="sample lengths for the seed-like pattern (default: dflash.data.seed_like_lengths())")
    p.add_argument("--seed", type=number(int, minimum=0), default=0)
    return p.parse_args()


def load_lengths(path: str | None) -> np.ndarray:
    if path is None:
        return seed_like_lengths(100_000)
    try:
        lengths = np.load(path)
    except (OSError, ValueError) as err:
        raise UserError(f"--lengths {path}: cannot read a .npy array ({err})") from None
    if lengths.ndim != 1 or lengths.size == 0 or not np.issubdtype(lengths.dtype, np.integer) or lengths.min() < 1:
        raise UserError(f"--lengths {path}: need a non-empty 1-D array of positive integers, got {lengths.dtype} "
                        f"of shape {lengths.shape}")
    return lengths


def make_lengths(pattern: str, total: int, max_len: int, rng: np.random.Generator, scale: float,
                 seed: np.ndarray) -> list[int]:
    """Sample lengths of `pattern` until they fill `total` tokens (the last one is cut); seed-like
    draws from the `seed` lengths."""
    out = []
    while sum(out) < total:
        if pattern == "seed-like":
            n = seed[rng.integers(len(seed))] * scale
        elif pattern == "constant":
            n = 2048 * scale
        elif pattern == "uniform":
            n = rng.uniform(64, 4096) * scale
        elif pattern == "long-tail":
            n = rng.pareto(1.5) * 300 * scale + 64 * scale
        else:  # bimodal: mostly short chats, some long documents
            n = (rng.uniform(64, 512) if rng.random() < 0.8 else rng.uniform(4096, 8192)) * scale
        out.append(int(min(max(n, 1), max_len)))
    out[-1] -= sum(out) - total
    return [n for n in out if n > 0]


def make_blocks(lengths, num_blocks, rng):
    """Blocks spread over the samples in proportion to their length, random anchors in [0, L)."""
    lengths = np.asarray(lengths)
    per = np.floor(num_blocks * lengths / lengths.sum()).astype(int)
    per[np.argmax(lengths)] += num_blocks - per.sum()
    seq = np.repeat(np.arange(len(lengths)), per)
    anchor = (rng.random(len(seq)) * lengths[seq]).astype(np.int64)
    return seq, anchor


def timer(device, repeats, deadline=None, warmup=True):
    """measure(fn) -> median seconds of `repeats` timed calls after an untimed warm-up (compiles,
    autotunes, builds per-batch masks and tile lists; none with `warmup` False). Raises TimeoutError
    past `deadline` (time.monotonic()) before starting a measurement."""
    def measure(fn):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("out of time")
        if warmup:
            fn()
        times = []
        for _ in range(repeats):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return measure


def fwd_bwd(fn, inputs, grad_out):
    def run():
        out = fn()
        torch.autograd.grad(out, inputs, grad_out)
    return run


# Competitors: each builder does the per-batch preparation (outside the timed calls) and returns
# (run, inputs): run() computes the output from `inputs`, the tensors fwd+bwd differentiates.

def padded_sdpa(q, k, v, lengths):
    """The padded baseline: every sample padded to the longest, as a padded data loader delivers
    them (the padding copy is not timed); causal with right padding is exact for the real rows."""
    s, lmax = len(lengths), max(lengths)
    idx = torch.cat([torch.arange(n, device=q.device) + i * lmax for i, n in enumerate(lengths)])

    def pad(x):
        buf = x.new_zeros(s * lmax, *x.shape[1:])
        return buf.index_copy(0, idx, x).view(s, lmax, *x.shape[1:]).transpose(1, 2).contiguous()

    qp, kp, vp = pad(q), pad(k), pad(v)

    def run():
        return torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
    return run, (qp, kp, vp)


def bench_varlen(lengths, cfg, measure, device, dtype, on_result=None):
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, cfg["head_dim"], device=device, dtype=dtype) for h in
               (cfg["heads"], cfg["kv_heads"], cfg["kv_heads"]))
    cu = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32, device=device)
    cu_cpu, max_len = cu.cpu(), max(lengths)

    def op(backend, **kwargs):  # per-batch preparation (tile lists, block masks) is cached per cu_seqlens
        return lambda: (lambda: varlen_attention(q, k, v, cu, max_len, backend=backend, cu_seqlens_cpu=cu_cpu,
                                                 **kwargs), (q, k, v))

    methods = {
        "dflash-triton": op("triton", deterministic=False),
        "dflash-triton-deterministic": op("triton", deterministic=True),
        "padded-sdpa": lambda: padded_sdpa(q, k, v, lengths),
        "flex-attention": op("flex"),
        "torch-varlen": op("torch_varlen"),
        "flash-attn": op("flash_attn"),
    }
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return run_methods(methods, pairs, cfg, measure, on_result)


def bench_block(lengths, cfg, measure, device, dtype, rng, on_result=None):
    total, b = sum(lengths), cfg["block_size"]
    seq, anchor = make_blocks(lengths, cfg["blocks"], rng)
    rows = len(seq) * b
    hq, hkv, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q, k_blk, v_blk = (torch.randn(rows, h, d, device=device, dtype=dtype) for h in (hq, hkv, hkv))
    k_ctx, v_ctx = (torch.randn(total, hkv, d, device=device, dtype=dtype) for _ in range(2))
    cu = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32, device=device)
    cu_cpu = cu.cpu()
    seq_t = torch.tensor(seq, dtype=torch.int32, device=device)
    anchor_t = torch.tensor(anchor, dtype=torch.int32, device=device)
    inputs = (q, k_ctx, v_ctx, k_blk, v_blk)

    def block(backend, deterministic=False):
        return lambda: (lambda: dflash_block_attention(*inputs, cu, seq_t, anchor_t, b, backend=backend,
                                                       cu_seqlens_cpu=cu_cpu, deterministic=deterministic), inputs)

    methods = {"dflash-triton": block("triton"), "dflash-triton-deterministic": block("triton", True),
               "flex-attention": block("flex")}
    pairs = int(sum(b * (a + b) for a in anchor))
    return run_methods(methods, pairs, cfg, measure, on_result)


def run_methods(methods, pairs, cfg, measure, on_result=None):
    """Forward, then forward+backward, of each method; `on_result(results)` after every measurement,
    so that a run cut short keeps what it measured."""
    flops_fwd = 4 * cfg["head_dim"] * cfg["heads"] * pairs
    results = {}
    for name, build in methods.items():
        r = results[name] = {}
        inputs = ()
        try:
            fn, inputs = build()
            with torch.no_grad():
                t = measure(fn)
            r.update(fwd_ms=t * 1e3, fwd_tflops=flops_fwd / t / 1e12)
            if on_result:
                on_result(results)
            for x in inputs:
                x.requires_grad_(True)
            grad_out = torch.randn_like(fn())
            t = measure(fwd_bwd(fn, inputs, grad_out))
            r.update(fwdbwd_ms=t * 1e3, fwdbwd_tflops=3.5 * flops_fwd / t / 1e12)
        except TimeoutError:
            r["skipped"] = "out of time"
        except Exception as e:  # a competitor that does not run here is recorded, not fatal
            r["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:140] if str(e) else ''}"
        finally:
            for x in inputs:
                x.requires_grad_(False)
        if on_result:
            on_result(results)
    return results


def write_json(path: Path, data) -> None:
    """Write `data` as JSON through a temporary file: a reader (or a kill) never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _line(r):
    parts = [f"{mode} {r[mode + '_ms']:9.3f} ms {r[mode + '_tflops']:7.2f} TFLOP/s"
             for mode in ("fwd", "fwdbwd") if mode + "_ms" in r]
    if "skipped" in r:
        parts.append(f"skipped: {r['skipped']}")
    return " | ".join(parts)


def write_chart(report, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG chart (the JSON has every number)")
        return
    panels = [("varlen", "fwd_tflops", "causal varlen forward"), ("varlen", "fwdbwd_tflops", "causal varlen fwd+bwd"),
              ("block", "fwd_tflops", "DFlash block forward"), ("block", "fwdbwd_tflops", "DFlash block fwd+bwd")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.2 * len(panels)))
    cases = list(report["results"])
    for ax, (op, metric, title) in zip(axes, panels, strict=True):
        methods = sorted({m for c in cases for m, r in report["results"][c][op].items() if metric in r})
        width = 0.8 / max(len(methods), 1)
        for i, m in enumerate(methods):
            vals = [report["results"][c][op].get(m, {}).get(metric, 0.0) for c in cases]
            ax.bar(np.arange(len(cases)) + i * width, vals, width, label=m)
        ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2, cases, rotation=20, fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(title)
        if methods:
            ax.legend(fontsize=7)
    fig.suptitle(f"{report['device']}, {report['config']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def bench_config(args, gpu: bool) -> dict:
    return {"tokens": args.tokens or (49152 if gpu else 256), "heads": args.heads or (32 if gpu else 2),
            "kv_heads": args.kv_heads or (8 if gpu else 1), "head_dim": args.head_dim or (128 if gpu else 32),
            "block_size": args.block_size, "blocks": args.blocks or (4096 if gpu else 16)}


def run_benchmark(cfg, patterns, seed_lengths, max_len, out_json: Path, repeats, seed=0, dtype=None,
                  deadline=None, report=None, warmup=True, orders=("sorted", "shuffled")) -> dict:
    """Every pattern in every order (sorted, shuffled), both ops, every method; the report (JSON) is
    rewritten after every measurement, so a run cut short (timeout, kill) keeps every finished number.
    Past `deadline` (time.monotonic()) the remaining measurements are recorded as skipped. Without
    `warmup` the per-batch preparation is timed with the call (a dry run that only shows it runs)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    measure = timer(device, repeats, deadline, warmup)
    rng = np.random.default_rng(seed)
    # lengths shrink with a reduced size, or by the caller's cfg["length_scale"] (gpu_check's dry run)
    scale = cfg.get("length_scale", cfg["tokens"] / 49152)
    report = report if report is not None else {}
    report.update({"device": torch.cuda.get_device_name() if device == "cuda" else
                   f"cpu ({platform.processor() or 'unknown'}), Triton interpreter: times are not kernel speed",
                   "torch": torch.__version__, "triton": _triton_version(), "dtype": str(dtype), "config": cfg,
                   "repeats": repeats, "pinned_configs": pin_configs(),
                   "timed": "the op call only: tile lists, FlexAttention block masks and padding are built once "
                            "per batch, before timing (warm-up call)" if warmup else
                            "the first call, per-batch preparation included (no warm-up call)", "results": {}})
    print(f"{report['device']} | {cfg} | {dtype}", flush=True)
    for pattern in patterns:
        base = make_lengths(pattern, cfg["tokens"], max_len, rng, scale, seed_lengths)
        for order in orders:
            lengths = sorted(base) if order == "sorted" else [base[i] for i in rng.permutation(len(base))]
            case = f"{pattern}/{order}"
            res = report["results"][case] = {"samples": len(lengths), "max_len": max(lengths)}
            for op in ("varlen", "block"):
                def save(results, _op=op, _res=res):
                    _res[_op] = results
                    write_json(out_json, report)
                if op == "varlen":
                    bench_varlen(lengths, cfg, measure, device, dtype, save)
                else:
                    bench_block(lengths, cfg, measure, device, dtype, rng, save)
                for name, r in res[op].items():
                    print(f"{case:18s} {op:6s} {name:27s} {_line(r)}", flush=True)
    return report


def _triton_version():
    import triton

    return triton.__version__


@exit_on_user_error
def main():
    args = parse_args()
    seed_lengths = load_lengths(args.lengths)
    gpu = torch.cuda.is_available()
    cfg = bench_config(args, gpu)
    max_len = max(1, int(args.max_len * cfg["tokens"] / 49152))
    repeats = args.repeats or ((5 if args.quick else 10) if gpu else 1)
    patterns = ("seed-like", "bimodal") if args.quick or not gpu else PATTERNS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run_benchmark(cfg, patterns, seed_lengths, max_len, out / "bench_kernels.json", repeats, args.seed)
    print(f"wrote {out / 'bench_kernels.json'}")
    write_chart(report, out / "bench_kernels.png")


if __name__ == "__main__":
    main()
