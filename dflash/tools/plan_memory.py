#!/usr/bin/env python
"""Will a training run fit? The memory plan per rank, before anything loads.

The options are train.py's, with its names and defaults (--model and --gpu-memory-gib, their older
names here, still work), but the target and the memory: a Qwen3-8B on 80 GiB GPUs unless told.
For the target of --target (a preset, a config.json or a model folder: transformers builds it on
the meta device to count its parameters), the drafter settings, the token budget, the ZeRO stage
of --deepspeed_config, the world size and the GPU memory, prints the peak per rank with the
target replicated (a full copy per rank) and partitioned (--target-partition zero3, with and
without --target-offload), what it is made of, the most drafter rows a micro-batch of the token
budget may score (the row budget train.py takes when none is given), and the largest token budget
that fits, and the anchor ceiling: the most anchors per sample (--num-anchors) one sample of each
length fits, 4,096 to 65,536 tokens. train.py runs the same plan at start and refuses a run that
cannot fit.

Examples:
  python launch/plan_memory.py --target qwen3-8b --world-size 8 --memory-gib 80
  python launch/plan_memory.py --target /models/Qwen3.5-122B-A10B --world-size 8 --memory-gib 141 \\
      --deepspeed_config ds_configs/zero3.json --token-budget 16384
"""
import argparse
import json
import os
import sys

from dflash.errors import UserError, exit_on_user_error
from dflash.options import given_as, number
from dflash.sizing.fit import accelerator_memory
from dflash.sizing.memory import (
    GIB,
    RESERVE_BYTES,
    RESERVE_FRACTION,
    MemoryPlan,
    MemorySetup,
    gib,
    plan_for,
)
from dflash.target.spec import PRESETS, load_target_spec
from dflash.training.config.load import PLANNING_DEFAULTS, add_options, options_of
from dflash.training.plan import kind_settings, loss_setup, resolve_run

CEILING_LENGTHS = (4096, 8192, 16384, 32768, 65536)  # sample lengths of the anchor ceiling
VARIANTS = {"replicated": dict(target_partition="none"), "zero3": dict(target_partition="zero3"),
            "zero3+offload": dict(target_partition="zero3", target_offload=True)}


# train.py's options, by name: the same flags, defaults and checks
PLANNED = ("target", "memory_gib", "token_budget", "row_budget", "deepspeed_config", "block_size", "num_anchors",
           "draft_layers", "num_target_features", "drafter_kind", "activation_checkpointing")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, PLANNED, PLANNING_DEFAULTS, aliases={"target": ["--model"], "memory_gib": ["--gpu-memory-gib"]},
                helps={"target": f"target: a preset ({', '.join(PRESETS)}), a config.json, a model folder, a Hub "
                                 "id or a .gguf file",
                       "memory_gib": "memory per GPU, GiB",
                       "row_budget": "drafter rows per micro-batch to estimate at (0: one sample's, block size x "
                                     "anchors)"})
    p.add_argument("--world-size", type=number(int, minimum=1), default=8,
                   help="ranks (GPUs) in all (default %(default)s)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="training dtype (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p.parse_args(argv)


def _ds_config(path: str, world_size: int) -> dict:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed parses the JSON; no guessing aloud on stdout
    from dflash.training.ds_config import load_ds_config

    return load_ds_config(path, world_size=world_size, grad_clip=1.0, bf16=True)


def summarize(plan: MemoryPlan, memory: int, tokens: int, rows: int) -> dict:
    peak = plan.peak(tokens, rows)
    return {"peak": peak["total"], "items": {k: v for k, v in peak.items() if k != "total"},
            "host_per_rank": plan.host_bytes(), "fits": plan.rows_that_fit(memory, tokens) >= rows,
            "row_budget_that_fits": plan.rows_that_fit(memory, tokens),
            "token_budget_that_fits": plan.tokens_that_fit(memory, plan.min_rows()),
            "anchor_ceiling": {length: plan.anchor_ceiling(memory, length) for length in CEILING_LENGTHS}}


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    """Lines of a table, the first column left-aligned and the others right-aligned, each as wide as
    its widest cell and two spaces apart: no figure, however large, runs into the next."""
    widths = [max(len(cell) for cell in column) for column in zip(head, *rows, strict=True)]
    return [f"{line[0]:<{widths[0]}}" + "".join(f"  {cell:>{w}}" for cell, w in zip(line[1:], widths[1:], strict=True))
            for line in (head, *rows)]


def print_table(args, plans: dict, results: dict, memory: int, rows: int) -> None:
    t = next(iter(plans.values())).target
    size = gib(t.params * (2 if args.dtype == "bf16" else 4))
    print(f"{args.target}: {t.params / 1e9:.2f}B parameters ({size} {args.dtype}), largest layer "
          f"{t.largest_layer / 1e6:.0f}M; {args.world_size} x {memory / GIB:g} GiB, "
          f"{gib(MemoryPlan.usable(memory))} usable per GPU ({RESERVE_FRACTION:.0%} and {gib(RESERVE_BYTES)} kept "
          f"free); {args.deepspeed_config}, {args.dtype}, token budget {args.token_budget:,}, {rows:,} drafter rows")
    lines = table(["target", "peak/GPU", "fits", "host/rank", "rows that fit", "tokens that fit"],
                  [[name, f"{r['peak'] / GIB:.1f}G", "yes" if r["fits"] else "NO", f"{r['host_per_rank'] / GIB:.1f}G",
                    f"{r['row_budget_that_fits']:,}", f"{r['token_budget_that_fits']:,}"]
                   for name, r in results.items()])
    print("\n".join([lines[0], "-" * len(lines[0]), *lines[1:]]))
    for name, r in results.items():
        print(f"\n{name}:")
        for item, value in r["items"].items():
            print(f"  {item:<62}{gib(value):>14}")
    print(f"\nanchor ceiling (most --num-anchors for one sample of each length, block size {args.block_size}):")
    print("\n".join(table(["target", *(f"{n:,} tok" for n in CEILING_LENGTHS)],
                          [[name, *(f"{r['anchor_ceiling'][n]:,}" for n in CEILING_LENGTHS)]
                           for name, r in results.items()])))
    print("\nrows that fit: the row budget train.py takes at this token budget (--row-budget 0); tokens that fit: "
          "the largest --token-budget with one sample's rows (block size x anchors)")


def planned_memory(args) -> int:
    """Bytes per GPU to plan for: --memory-gib, or with 0 (as train.py) this machine's GPU's own."""
    import torch

    if args.memory_gib:
        return int(args.memory_gib * GIB)
    if not torch.cuda.is_available():
        raise UserError(f"{given_as(args, 'memory_gib', '--memory-gib')} 0: 0 is the GPU's own memory, and this "
                        "machine has no GPU; give the memory per GPU in GiB")
    return accelerator_memory("cuda", 0)


def check_taps(spec, num_features: int) -> None:
    """The tap rule spreads --num-target-features over the target's layers (its config.json): more than
    it has room for is refused, as train.py would once the target loads."""
    try:
        taps = spec.default_layer_ids(num_features)
    except ValueError as err:
        raise UserError(f"--num-target-features {num_features}: {err}") from None
    if len(set(taps)) < num_features:
        raise UserError(f"--num-target-features {num_features}: the target has {spec.num_layers} layers, and the "
                        f"tap rule spreads at most {len(set(spec.default_layer_ids(spec.num_layers)))} distinct "
                        "taps over them (layers 1 to L-3); give fewer")


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    cfg = options_of(args, PLANNED)
    memory = planned_memory(args)
    spec = load_target_spec(args.target, "--target", bare_presets=True)
    check_taps(spec, args.num_target_features)
    ds_config = _ds_config(args.deepspeed_config, args.world_size)
    base = dict(world_size=args.world_size, dtype_bytes=2 if args.dtype == "bf16" else 4,
                activation_checkpointing=args.activation_checkpointing, block_size=args.block_size,
                num_anchors=args.num_anchors)
    run = resolve_run(cfg, spec)  # as train.py resolves its options
    base.update(loss_setup(run, "cuda"))  # the objective's share, as train.py plans it on a GPU
    settings = kind_settings(run)  # the kind's released settings, checked against the target as train.py does
    plans = {name: plan_for(spec, MemorySetup.from_ds_config(ds_config, **base, **variant),
                            draft_layers=args.draft_layers, features=args.num_target_features,
                            kind=cfg.drafter.drafter_kind, kind_settings=settings)
             for name, variant in VARIANTS.items()}
    rows = max(args.row_budget, args.block_size * args.num_anchors)
    results = {name: summarize(plan, memory, args.token_budget, rows) for name, plan in plans.items()}
    if args.json:
        json.dump({"model": args.target, "world_size": args.world_size, "gpu_memory": memory,
                   "token_budget": args.token_budget, "rows": rows, "plan": next(iter(plans.values())).to_dict(),
                   **results}, sys.stdout, indent=2)
        print()
        return results
    print_table(args, plans, results, memory, rows)
    return results


if __name__ == "__main__":
    main()
