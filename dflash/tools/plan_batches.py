#!/usr/bin/env python
"""Plan one epoch in every order x layout and show what each costs, and how evenly it loads the ranks.

For sorted / shuffle / bucketed orders, each padded and packed, twice: the token-only plan
(round robin to ranks, no row cap) and the cost-balanced plan (drafter row budget, micro-batches
of similar cost dealt to the ranks of each index). Columns: padding efficiency (real / computed
tokens), budget fill (real tokens / (micro-batches x budget)), micro-batches per epoch and per
rank, length mixing per micro-batch and per step (share of length variance explained by
membership; low = i.i.d.), cost balance per micro-batch index and per step (mean / max over
ranks of the cost, averaged: the share of time not spent waiting for the slowest rank), drafter
rows per micro-batch (p50 / max) and planning seconds.

The cost of a sample comes from the target's and drafter's sizes (--target: a preset or a
config.json of any target family: MoE layers priced by their active experts, Gated DeltaNet
layers per token, sliding-window layers by the pairs their window leaves, MLA by its head dims;
--drafter-kind K: what the drafter kind adds per row too) and its drafter
rows, block_size x min(anchors, candidates), from the supervised token counts (--supervised
with --lengths, else every token counts as supervised; the store's loss masks with --data).
Without --lengths or --data it plans the built-in seed-like distribution (902,000 samples shaped
like the seed run's data set) with supervised shares drawn from Beta(4, 2) (as
shared/data/make_seed_supervised.py).

--save-plan PLAN.npz writes every mode's plan: `<order>-<layout>/samples` (all sample indices),
`/offsets` (micro-batch boundaries into samples), `/ranks` (each micro-batch's rank); micro-batches
come index by index, so each rank's come in its execution order.

Examples:
  python launch/plan_batches.py --token-budget 49152 --world-size 8
  python launch/plan_batches.py --lengths seed_lengths.npy --supervised seed_supervised.npy --world-size 64
  python launch/plan_batches.py --data data/store --token-budget 16384 --world-size 8 --target target/ --json
"""
import argparse
import dataclasses
import json
import sys
import time

import numpy as np

from dflash.data.buckets import padded_cost, quantile_buckets
from dflash.data.cost import drafter_rows
from dflash.data.plan_stats import dealing_stats, plan_stats
from dflash.data.planner import (
    DEFAULT_MIX,
    LAYOUTS,
    ORDERS,
    PlannerConfig,
    bucket_edges,
    check_lengths,
    check_rows,
    plan_batches,
)
from dflash.data.seed_lengths import SEED_BOUNDARIES, SEED_TOKEN_BUDGET, seed_like_lengths
from dflash.data.supervision import candidates_from_supervised
from dflash.drafter.kinds import drafter_kind
from dflash.errors import UserError, exit_on_user_error
from dflash.options import number, parse_list
from dflash.sizing.flops import flop_cost_model, load_target_config
from dflash.target.spec import PRESETS
from dflash.target.taps import default_target_layer_ids
from dflash.training.config.load import PLANNING_DEFAULTS, add_options, options_of
from dflash.training.config.sections import KIND_OPTIONS

# train.py's options, by name: the same flags, defaults and checks (but the planning target and budgets);
# with the drafter kinds' own (`planned`)
PLANNED = ("target", "token_budget", "seed", "packing_window", "draft_layers", "block_size", "num_anchors",
           "row_budget", "drafter_kind")
DEFAULT_ROW_BUDGET = 327_680  # 20 x 16,384: caps the seed-like worst case (553K) at 0.6x for < 3% more micro-batches


def planned() -> tuple[str, ...]:
    """`PLANNED` and every registered kind's own options, as the parser is built."""
    return (*PLANNED, *KIND_OPTIONS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", help=".npy file of sample lengths")
    src.add_argument("--data", help="token store folder (from launch/prepare_data.py)")
    defaults = {**PLANNING_DEFAULTS, "token_budget": SEED_TOKEN_BUDGET, "row_budget": DEFAULT_ROW_BUDGET}
    add_options(p, planned(), defaults,
                aliases={"target": ["--model"], "num_anchors": ["--anchors"], "packing_window": ["--window"]},
                helps={"target": f"target for the cost model: a preset ({', '.join(PRESETS)}) or a config.json (or its "
                                 "folder) of a dense, MoE, hybrid Gated DeltaNet, sliding-window or MLA target",
                       "row_budget": "drafter rows per micro-batch at most, in the balanced plans (0: no cap)"})
    p.add_argument("--world-size", type=number(int, minimum=1), default=1, help="number of ranks (default %(default)s)")
    b = p.add_mutually_exclusive_group()
    add_options(b, ["buckets"])
    b.add_argument("--boundaries", type=lambda text: parse_list(text, "--boundaries", increasing=True, minimum=0),
                   help="bucket boundaries, e.g. 770,1216,1728,2432,3296")
    p.add_argument("--epoch", type=number(int, minimum=0), default=0, help="epoch to plan (default %(default)s)")
    p.add_argument("--supervised", help=".npy file of supervised token counts that go with --lengths")
    p.add_argument("--target-layers", type=number(int, minimum=1),
                   help="target layers run for the features (default: last default tap + 1, e.g. 34 for Qwen3-8B)")
    p.add_argument("--micro-batches-per-step", type=number(int, minimum=1), default=DEFAULT_MIX,
                   help="micro-batches per rank in a step, for the per-step numbers and the dealing "
                   "(default %(default)s)")
    p.add_argument("--save-plan", help="write every mode's balanced plan (token-only with --no-balance) to this .npz")
    p.add_argument("--no-balance", action="store_true", help="save the token-only plans instead of the balanced ones")
    p.add_argument("--json", action="store_true", help="print JSON keyed '<order>-<layout>' instead of a table")
    return p.parse_args(argv)


def _load_npy(flag: str, path: str) -> np.ndarray:
    try:
        return np.load(path)
    except (OSError, ValueError) as e:
        raise UserError(f"{flag} {path}: cannot read a .npy array ({e})") from None


def _load_counts(flag: str, path: str) -> np.ndarray:
    """A .npy file of token counts, one per sample: 1-D, and finite whole numbers when stored as
    floats (a NaN would be planned as some arbitrary integer)."""
    values = _load_npy(flag, path)
    numeric = np.issubdtype(values.dtype, np.integer) or np.issubdtype(values.dtype, np.floating)
    if values.ndim != 1 or not numeric:
        raise UserError(f"{flag} {path}: expected a 1-D array of token counts, got {values.dtype} of shape "
                        f"{values.shape}")
    if np.issubdtype(values.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(values) | (values != np.round(values)))
        if bad.size:
            i = int(bad[0])
            raise UserError(f"{flag} {path}: sample {i} has {values[i]} tokens ({bad.size} sample(s) are not finite "
                            "whole numbers); every count must be a whole number of tokens")
    return values.astype(np.int64)


def load_data(args) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """(lengths, supervised, anchor candidates, source) of the samples to plan."""
    if args.supervised and not args.lengths:
        raise UserError("--supervised goes with --lengths (a store has its own; the built-in lengths draw theirs)")
    if args.lengths:
        lengths = _load_counts("--lengths", args.lengths)
        if not args.supervised:  # the drafter's rows follow from the supervised tokens: assume all of them
            print("plan_batches: no --supervised; every token counted as supervised (drafter rows are upper bounds)",
                  file=sys.stderr)
            supervised = np.asarray(lengths, dtype=np.int64)
            return lengths, supervised, candidates_from_supervised(supervised), args.lengths
        supervised = _load_counts("--supervised", args.supervised)
        if supervised.shape != lengths.shape:
            raise UserError(f"--supervised {args.supervised}: {supervised.size} counts for {lengths.size} lengths")
        if (supervised < 0).any() or (supervised > lengths).any():
            i = int(np.flatnonzero((supervised < 0) | (supervised > lengths))[0])
            raise UserError(f"--supervised {args.supervised}: sample {i} has {int(supervised[i])} supervised tokens "
                            f"of {int(lengths[i])}")
        return lengths, supervised, candidates_from_supervised(supervised), args.lengths
    if args.data:
        from dflash.data.token_store import TokenStore

        store = TokenStore(args.data)
        return store.lengths, store.supervised, store.candidates(), args.data
    lengths = seed_like_lengths().astype(np.int64)
    share = np.random.default_rng(1).beta(4.0, 2.0, lengths.size)
    supervised = np.clip((lengths * share).astype(np.int64), 1, lengths)
    source = "built-in seed-like lengths (902,000 samples, supervised share ~ Beta(4, 2))"
    return lengths, supervised, candidates_from_supervised(supervised), source


def save_plans(path: str, plans: dict) -> None:
    arrays = {}
    for mode, plan in plans.items():
        batches = [plan[r][i] for i in range(len(plan[0])) for r in range(len(plan))]
        arrays[f"{mode}/samples"] = np.concatenate(batches).astype(np.int64)
        arrays[f"{mode}/offsets"] = np.concatenate([[0], np.cumsum([len(b) for b in batches])]).astype(np.int64)
        arrays[f"{mode}/ranks"] = np.tile(np.arange(len(plan), dtype=np.int64), len(plan[0]))
    try:
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    except OSError as e:
        raise UserError(f"--save-plan {path}: cannot write ({e})") from None


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    cfg = options_of(args, (*planned(), "buckets"))
    lengths, supervised, candidates, source = load_data(args)
    lengths = check_lengths(lengths, args.token_budget)
    target = load_target_config(args.target)
    layers = args.target_layers or max(default_target_layer_ids(target.num_hidden_layers)) + 1
    kind = drafter_kind(cfg.drafter.drafter_kind)
    extra = kind.row_flops(target.hidden_size, args.draft_layers, args.block_size, kind.released_settings(), cfg.loss,
                           vocab=int(target.vocab_size))
    model = flop_cost_model(target, num_target_layers=layers, draft_layers=args.draft_layers,
                            block_size=args.block_size, extra_row_flops=extra)
    rows = drafter_rows(candidates, supervised, args.block_size, args.num_anchors)
    check_rows(rows, lengths, args.row_budget or None)
    costs = model.sample_costs(lengths, rows)
    k = args.micro_batches_per_step
    base = PlannerConfig(args.token_budget, boundaries=args.boundaries, seed=args.seed, world_size=args.world_size,
                         window=args.packing_window, buckets=args.buckets)
    edges = bucket_edges(lengths, base)
    base = dataclasses.replace(base, boundaries=tuple(edges.tolist()))
    results, saved = {}, {}
    balanced = dict(rows=rows, costs=costs)
    for order in ORDERS:
        for layout in LAYOUTS:
            for variant, extra in (("tokens", {}), ("balanced", balanced)):
                t0 = time.perf_counter()
                config = dataclasses.replace(base, order=order, layout=layout, **(
                    dict(row_budget=args.row_budget or None, balance=True, mix=k) if extra else {}))
                plan = plan_batches(lengths, config, epoch=args.epoch, **extra)
                seconds = time.perf_counter() - t0
                batches = [b for rank in plan for b in rank]
                stats = plan_stats(lengths, batches, layout, args.token_budget)
                stats.update(dealing_stats(plan, model, rows, layout, lengths, k))
                results.setdefault(f"{order}-{layout}", {})[variant] = {
                    **stats, "batches_per_rank": len(plan[0]), "plan_seconds": seconds}
                if (variant == "tokens") == args.no_balance:
                    saved[f"{order}-{layout}"] = plan
    if args.save_plan:
        save_plans(args.save_plan, saved)
    quantile = quantile_buckets(lengths, len(edges) - 1, args.token_budget)
    buckets = {
        "boundaries": edges.tolist(),
        "method": "given" if args.boundaries is not None else "optimal (exact DP)",
        "quantile_boundaries": quantile.tolist(),
        "padded_cost_bound": {"used": padded_cost(lengths, edges), "quantile": padded_cost(lengths, quantile)},
    }
    if args.json:
        json.dump({"source": source, "samples": int(lengths.size), "tokens": int(lengths.sum()),
                   "token_budget": args.token_budget, "world_size": args.world_size, "seed": args.seed,
                   "row_budget": args.row_budget, "micro_batches_per_step": k, "model": args.target,
                   "drafter_kind": args.drafter_kind,
                   "cost_model": model.to_dict(), "lower_bound_batches": -(-int(lengths.sum()) // args.token_budget),
                   **results, "buckets": buckets}, sys.stdout, indent=2)
        print()
        return
    print(f"{source}: {lengths.size:,} samples, {int(lengths.sum()):,} tokens, budget {args.token_budget:,}, "
          f"world size {args.world_size}, {k} micro-batches per step")
    print(f"cost model ({args.target}, {layers} target layers, {args.draft_layers}-layer {args.drafter_kind} "
          "drafter): "
          f"{model.per_token / 1e9:.2f} GFLOP/token + {model.per_pair / 1e9:.2e} GFLOP x length^2 + "
          f"{model.per_row / 1e9:.2f} GFLOP/row + {model.per_row_key / 1e9:.2e} GFLOP x rows x length; "
          f"row budget {args.row_budget:,} (balanced rows)")
    print(f"bucket boundaries ({buckets['method']}): {edges.tolist()}")
    print(f"lower bound: {-(-int(lengths.sum()) // args.token_budget):,} micro-batches per epoch\n")
    head = (f"{'mode':<27}{'effic.':>8}{'fill':>8}{'batches':>9}{'/rank':>7}{'len R2':>8}{'step R2':>8}"
            f"{'bal mb':>8}{'bal step':>9}{'rows p50':>10}{'rows max':>10}{'plan s':>8}")
    print(head)
    print("-" * len(head))
    for mode, variants in results.items():
        for variant, r in variants.items():
            print(f"{mode + ' ' + variant:<27}{r['efficiency']:>8.2%}{r['fill']:>8.2%}{r['batches']:>9,}"
                  f"{r['batches_per_rank']:>7,}{r['length_r2']:>8.3f}{r['step_length_r2']:>8.4f}"
                  f"{r['balance_micro']:>8.3f}{r['balance_step']:>9.3f}{r['rows_p50']:>10,.0f}{r['rows_max']:>10,}"
                  f"{r['plan_seconds']:>8.2f}")
    if tuple(edges.tolist()) != SEED_BOUNDARIES and args.boundaries is None and not (args.lengths or args.data):
        print(f"\n(the seed's hand-picked boundaries were {list(SEED_BOUNDARIES)}; try --boundaries to compare)")


if __name__ == "__main__":
    main()
