"""Offline compile gate of the Triton kernels (attention; the block convolution and the fused head): no GPU needed.

Compiles every kernel and autotune config with Triton's compiler and ptxas (both ship in the
triton wheel) for each GPU architecture, head dim and dtype the ops accept, and reports shared
memory, registers and spills. A config fits when its shared memory is within the block limit
of the architecture and it does not spill; at their first launch the kernels prune the configs
that do not fit (dflash/ops/common/compile_check.py), keeping the least-spilling ones where every
config spills. Exit status 1 when some (kernel, arch, head dim, dtype) has no config that fits
without spilling; where none even fits shared memory the ops refuse the case and name another backend.
float16 compiles like bfloat16 (same sizes); it is checked only when asked for.

    python launch/compile_kernels.py                       # table, every case (about an hour on 2 cores)
    python launch/compile_kernels.py --arch 90 --head-dim 128 --dtype bfloat16 --json out.json --table
    python launch/compile_kernels.py --records out.json --table    # the table again, from saved records

Triton 3.6 (the GPU image's) beside the newest: docs/BENCHMARKS.md says how to run the gate in a
second environment.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the GPU tile sizes and real JIT functions, not the interpreter's

import torch
import triton
from tqdm import tqdm

from dflash.ops.common.compile_check import ARCH_NAMES, MAX_SHARED, compile_config
from dflash.options import number

# constexprs that tell a kernel's cases apart
REPORTED = ("CAUSAL", "HAS_WINDOW", "B", "BLOCK_M", "BLOCK_N", "OWN_M", "FUSED_DQ", "H", "G", "K", "SOFTCAP")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=number(int, minimum=0), nargs="+",
                   default=sorted(ARCH_NAMES), choices=sorted(ARCH_NAMES),
                   help="compute capabilities (80 = sm_80, 90 = sm_90a, 100 = sm_100a, 120 = sm_120a)")
    p.add_argument("--head-dim", type=number(int, minimum=1), nargs="+",
                   default=[16, 32, 64, 128, 256], choices=[16, 32, 64, 128, 256])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    p.add_argument("--op", nargs="+", default=["varlen", "block", "conv", "head"],
                   choices=["varlen", "block", "conv", "head"],
                   help="conv: the block convolution of convolution drafters (hidden = heads x head dim, groups 16, "
                        "kernel 2, block 16); "
                        "head: the fused head (top-16, with and without softcap; once, whatever the head dim)")
    p.add_argument("--heads", type=number(int, minimum=1), default=32, help="query heads (default 32, Qwen3-8B)")
    p.add_argument("--kv-heads", type=number(int, minimum=1), default=8, help="key/value heads (default 8)")
    p.add_argument("--first-only", action="store_true", help="only the first config of each kernel (a quick check)")
    p.add_argument("--causal-only", action="store_true", help="varlen: only the causal kernels (the target's)")
    p.add_argument("--sliding-only", action="store_true",
                   help="block: only the sliding-layer variants (HAS_WINDOW, causal or not: a drafter's "
                        "sliding_attention, or all bidirectional as a kind may release them)")
    p.add_argument("--kernel", nargs="+", metavar="NAME",
                   help="only these kernels (e.g. _fwd_kernel: the block forward, or varlen's, with --op)")
    p.add_argument("--jobs", type=number(int, minimum=1), default=min(4, os.cpu_count() or 1),
                   help="compiler processes")
    p.add_argument("--json", metavar="FILE", help="write the records as JSON to FILE ('-' for stdout)")
    p.add_argument("--table", action="store_true",
                   help="print a Markdown table: configs fitting per kernel and arch, and the pinned config")
    p.add_argument("--records", metavar="FILE", help="read records saved by --json instead of compiling")
    return p.parse_args(argv)


def _cases(op, head_dim, heads, kv_heads, dtype, arch):
    """(autotuned kernel, constexprs) of `op` as launched on `arch`; the delta preprocess serves
    both ops and is reported with varlen."""
    from dflash.ops.common import delta

    if op == "conv":
        from dflash.ops.block_conv.triton_kernels import compile_cases

        return compile_cases(heads * head_dim)
    if op == "head":
        from dflash.ops.head_topk.triton_kernels import compile_cases

        return compile_cases(softcap=True) + compile_cases(softcap=False)
    if op == "varlen":
        from dflash.ops.varlen.triton_kernels import compile_cases

        return compile_cases(head_dim, heads, kv_heads, DTYPES[dtype], arch) + delta.compile_cases(head_dim, heads)
    from dflash.ops.dflash_block.triton_kernels import compile_cases

    return compile_cases(head_dim, heads, kv_heads, DTYPES[dtype])


def _job(task):
    op, index, config_index, arch, head_dim, dtype, heads, kv_heads = task
    tuner, constexprs = _cases(op, head_dim, heads, kv_heads, dtype, arch)[index]
    record = compile_config(tuner.fn, DTYPES[dtype], constexprs, tuner.configs[config_index], arch)
    return {**record, "op": op, "head_dim": head_dim, "dtype": dtype,
            "constexprs": {k: v for k, v in constexprs.items() if k in REPORTED}}


def tasks(args):
    out = []
    for op in args.op:
        for head_dim in args.head_dim if op != "head" else args.head_dim[:1]:
            for dtype in args.dtype:
                for arch in args.arch:
                    cases = _cases(op, head_dim, args.heads, args.kv_heads, dtype, arch)
                    for index, (tuner, constexprs) in enumerate(cases):
                        if op == "varlen" and args.causal_only and constexprs.get("CAUSAL") is False:
                            continue
                        if op == "block" and args.sliding_only and not constexprs.get("HAS_WINDOW"):
                            continue
                        if args.kernel and tuner.fn.__name__ not in args.kernel:
                            continue
                        out += [(op, index, config_index, arch, head_dim, dtype, args.heads, args.kv_heads)
                                for config_index in range(1 if args.first_only else len(tuner.configs))]
    return out


def unservable(records):
    """{(kernel, arch, head_dim, dtype, constexprs): reason} for the groups in which no config fits
    without spilling: "spills" (runs, slowly: the kernels keep the least-spilling configs) or
    "shared memory" (cannot launch: the ops refuse it and name another backend)."""
    groups = {}
    for r in records:
        key = (r["kernel"], r["arch"], r["head_dim"], r["dtype"], json.dumps(r["constexprs"], sort_keys=True))
        launches = r["shared_bytes"] <= MAX_SHARED[next(c for c, n in ARCH_NAMES.items() if n == r["arch"])]
        fits, any_launch = groups.get(key, (False, False))
        groups[key] = (fits or r["fits"], any_launch or launches)
    return {k: "spills" if launch else "shared memory" for k, (fits, launch) in sorted(groups.items()) if not fits}


def _speed(record) -> tuple:
    """compile_check.expected_speed of a record's config name ("BLOCK_M=32,warps=8,stages=2")."""
    values = dict(part.split("=") for part in record["config"].split(","))
    tiles = [int(v) for k, v in values.items() if k not in ("warps", "stages")]
    return math.prod(tiles), int(values["stages"]), int(values["warps"])


def table(records) -> str:
    """Markdown: per kernel variant and arch, the configs that fit without spilling and the pinned
    one (deterministic mode, DFLASH_PIN_CONFIGS=1: the fastest expected that fits)."""
    groups = {}
    for r in records:
        variant = " (atomic dQ)" if r["constexprs"].get("FUSED_DQ") else (
            " (deterministic)" if "FUSED_DQ" in r["constexprs"] else "")
        causal = {True: " causal", False: " full"}.get(r["constexprs"].get("CAUSAL"), "")
        if "HAS_WINDOW" in r["constexprs"]:  # block attention: a drafter's sliding or full layers
            causal = ((" sliding causal" if r["constexprs"]["CAUSAL"] else " sliding bidirectional")
                      if r["constexprs"]["HAS_WINDOW"] else " full")
        tile = ",".join(f"{k}={v}" for k, v in r["constexprs"].items() if k in ("BLOCK_M", "BLOCK_N", "OWN_M"))
        key = (r["op"], f"`{r['kernel']}`{causal}{variant}", r["arch"], f"d{r['head_dim']} {r['dtype']}", tile)
        groups.setdefault(key, []).append(r)
    lines = ["| op | kernel | arch | head dim, dtype | tile | fitting / compiled | pinned config | its registers, "
             "shared bytes |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, group in sorted(groups.items()):
        fits = sorted((r for r in group if r["fits"]), key=_speed, reverse=True)
        pinned = (f"{fits[0]['config']} | {fits[0]['registers']}, {fits[0]['shared_bytes']}" if fits
                  else "none fits | ")
        lines.append(f"| {' | '.join(key)} | {len(fits)} / {len(group)} | {pinned} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.records:
        records = json.loads(Path(args.records).read_text())
        if args.table:
            print(table(records))
        return 1 if unservable(records) else 0
    todo = tasks(args)
    records = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for r in tqdm(pool.map(_job, todo), total=len(todo), desc="compiling", file=sys.stderr):
            records.append(r)
            if args.json != "-":
                flag = "" if r["fits"] else "  DOES NOT FIT" if r["spills"] == 0 else "  SPILLS"
                print(f"{r['op']:6s} {r['kernel']:22s} {r['arch']:8s} d{r['head_dim']:<4d} {r['dtype']:9s} "
                      f"{json.dumps(r['constexprs']):16s} {r['config']:34s} shared {r['shared_bytes']:7d} "
                      f"regs {r['registers']:3d} spill {r['spills']:5d}{flag}", flush=True)
            if args.json and args.json != "-":  # rewritten as it goes: a run cut short keeps its records
                Path(args.json).write_text(json.dumps(records, indent=1))
    if args.json == "-":
        print(json.dumps(records, indent=1))
    if args.table:
        print(f"triton {triton.__version__}\n{table(records)}")
    bad = unservable(records)
    for key, reason in bad.items():
        why = "every config spills" if reason == "spills" else "none fits shared memory: refused"
        print(f"no config fits without spilling ({why}): {key[0]} {key[1]} head_dim {key[2]} {key[3]} {key[4]}",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
