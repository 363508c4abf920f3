"""Benchmark dflash's Triton attention kernels against the public alternatives.

Causal varlen attention (the target's): ours vs padded SDPA and the library backends of
dflash.ops (FlexAttention with a document mask, torch.nn.attention.varlen (FlashAttention-2),
flash-attn's varlen function) where they run. DFlash block attention (the drafter's): ours vs
FlexAttention with the block mask (backend="flex"). Ours runs twice: dQ accumulated with
atomics (the default) and deterministic=True (dQ in a kernel of its own).
Length patterns (seed-like, constant, uniform, long-tail, bimodal), each sorted and shuffled,
packed to a real micro-batch (49,152 tokens). TFLOP/s count visible query-key pairs only
(forward 4*D per pair and head; forward+backward 3.5x that).

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
from dflash.ops.common.compile_check import PIN_ENV

PATTERNS = ("seed-like", "constant", "uniform", "long-tail", "bimodal")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_kernels", help="folder for bench_kernels.json and .png")
    p.add_argument("--quick", action="store_true", help="seed-like and bimodal only, fewer repeats")
    p.add_argument("--tokens", type=int, default=None, help="tokens per call (default 49152; 256 on the CPU)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 32; 2 on the CPU)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default 8; 1 on the CPU)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128; 32 on the CPU)")
    p.add_argument("--block-size", type=int, default=16, help="DFlash block size B")
    p.add_argument("--blocks", type=int, default=None,
                   help="DFlash blocks per call, spread over the samples by length (default 4096; 16 on the CPU)")
    p.add_argument("--max-len", type=int, default=8192, help="longest sample (scaled down on the CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (median)")
    p.add_argument("--lengths", metavar="F.npy", default=None,
                   help="sample lengths for the seed-like pattern (default: dflash.data.seed_like_lengths())")
    p.add_argument("--seed", type=int, default=0)
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


def timer(device, repeats):
    def measure(fn):
        fn()  # warm-up: compiles and autotunes
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


# Competitors: each returns a callable producing the (tokens, heads, dim) output, or raises.

def padded_sdpa(q, k, v, lengths):
    """Pads every sample to the longest (the padded baseline); causal with right padding is exact."""
    s, lmax = len(lengths), max(lengths)
    idx = torch.cat([torch.arange(n, device=q.device) + i * lmax for i, n in enumerate(lengths)])

    def pad(x):
        buf = x.new_zeros(s * lmax, *x.shape[1:])
        return buf.index_copy(0, idx, x).view(s, lmax, *x.shape[1:]).transpose(1, 2)

    def run():
        o = torch.nn.functional.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(s * lmax, *q.shape[1:])[idx]
    return run


def bench_varlen(lengths, cfg, measure, device, dtype):
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, cfg["head_dim"], device=device, dtype=dtype) for h in
               (cfg["heads"], cfg["kv_heads"], cfg["kv_heads"]))
    cu = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32, device=device)
    cu_cpu, max_len = cu.cpu(), max(lengths)
    methods = {
        "dflash-triton": lambda: (lambda: varlen_attention(q, k, v, cu, max_len, backend="triton",
                                                           cu_seqlens_cpu=cu_cpu, deterministic=False)),
        "dflash-triton-deterministic": lambda: (lambda: varlen_attention(q, k, v, cu, max_len, backend="triton",
                                                                         cu_seqlens_cpu=cu_cpu, deterministic=True)),
        "padded-sdpa": lambda: padded_sdpa(q, k, v, lengths),
        "flex-attention": lambda: (lambda: varlen_attention(q, k, v, cu, max_len, backend="flex")),
        "torch-varlen": lambda: (lambda: varlen_attention(q, k, v, cu, max_len, backend="torch_varlen")),
        "flash-attn": lambda: (lambda: varlen_attention(q, k, v, cu, max_len, backend="flash_attn")),
    }
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return run_methods(methods, (q, k, v), pairs, cfg, measure)


def bench_block(lengths, cfg, measure, device, dtype, rng):
    total, b = sum(lengths), cfg["block_size"]
    seq, anchor = make_blocks(lengths, cfg["blocks"], rng)
    rows = len(seq) * b
    hq, hkv, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q, k_blk, v_blk = (torch.randn(rows, h, d, device=device, dtype=dtype) for h in (hq, hkv, hkv))
    k_ctx, v_ctx = (torch.randn(total, hkv, d, device=device, dtype=dtype) for _ in range(2))
    cu = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32, device=device)
    seq_t = torch.tensor(seq, dtype=torch.int32, device=device)
    anchor_t = torch.tensor(anchor, dtype=torch.int32, device=device)

    def block(backend, deterministic=False):
        return lambda: (lambda: dflash_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, cu, seq_t, anchor_t, b,
                                                       backend=backend, cu_seqlens_cpu=cu.cpu(),
                                                       deterministic=deterministic))

    methods = {"dflash-triton": block("triton"), "dflash-triton-deterministic": block("triton", True),
               "flex-attention": block("flex")}
    pairs = int(sum(b * (a + b) for a in anchor))
    return run_methods(methods, (q, k_ctx, v_ctx, k_blk, v_blk), pairs, cfg, measure)


def run_methods(methods, inputs, pairs, cfg, measure):
    flops_fwd = 4 * cfg["head_dim"] * cfg["heads"] * pairs
    results = {}
    for name, build in methods.items():
        r = results[name] = {}
        try:
            fn = build()
            with torch.no_grad():
                t = measure(fn)
            r.update(fwd_ms=t * 1e3, fwd_tflops=flops_fwd / t / 1e12)
            for x in inputs:
                x.requires_grad_(True)
            grad_out = torch.randn_like(fn())
            t = measure(fwd_bwd(fn, inputs, grad_out))
            r.update(fwdbwd_ms=t * 1e3, fwdbwd_tflops=3.5 * flops_fwd / t / 1e12)
        except Exception as e:  # a competitor that does not run here is recorded, not fatal
            r["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:140] if str(e) else ''}"
        finally:
            for x in inputs:
                x.requires_grad_(False)
    return results


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


@exit_on_user_error
def main():
    args = parse_args()
    seed_lengths = load_lengths(args.lengths)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = device == "cuda"
    cfg = {"tokens": args.tokens or (49152 if gpu else 256), "heads": args.heads or (32 if gpu else 2),
           "kv_heads": args.kv_heads or (8 if gpu else 1), "head_dim": args.head_dim or (128 if gpu else 32),
           "block_size": args.block_size, "blocks": args.blocks or (4096 if gpu else 16)}
    scale = cfg["tokens"] / 49152  # lengths shrink with the reduced CPU size
    max_len = max(1, int(args.max_len * scale))
    dtype = torch.bfloat16 if gpu else torch.float32
    repeats = args.repeats or ((5 if args.quick else 10) if gpu else 1)
    patterns = ("seed-like", "bimodal") if args.quick or not gpu else PATTERNS
    measure = timer(device, repeats)
    rng = np.random.default_rng(args.seed)
    report = {"device": torch.cuda.get_device_name() if gpu else f"cpu ({platform.processor() or 'unknown'}), "
              "Triton interpreter: reduced size, times are not kernel speed",
              "torch": torch.__version__, "dtype": str(dtype), "config": cfg, "repeats": repeats,
              "pinned_configs": os.environ.get(PIN_ENV, "0") not in ("", "0"), "results": {}}
    print(f"{report['device']} | {cfg} | {dtype}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for pattern in patterns:
        base = make_lengths(pattern, cfg["tokens"], max_len, rng, scale, seed_lengths)
        for order in ("sorted", "shuffled"):
            lengths = sorted(base) if order == "sorted" else [base[i] for i in rng.permutation(len(base))]
            case = f"{pattern}/{order}"
            res = {"samples": len(lengths), "max_len": max(lengths),
                   "varlen": bench_varlen(lengths, cfg, measure, device, dtype),
                   "block": bench_block(lengths, cfg, measure, device, dtype, rng)}
            report["results"][case] = res
            for op in ("varlen", "block"):
                for name, r in res[op].items():
                    print(f"{case:18s} {op:6s} {name:27s} {_line(r)}")
            # Rewritten after every case, so a run cut short by a time limit keeps its numbers.
            (out / "bench_kernels.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'bench_kernels.json'}")
    write_chart(report, out / "bench_kernels.png")


if __name__ == "__main__":
    main()
