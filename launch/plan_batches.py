#!/usr/bin/env python
"""Plan one epoch in every order x layout and show what each costs.

For sorted / shuffle / bucketed orders, each padded and packed: padding efficiency (real /
computed tokens), budget fill (real tokens / (micro-batches x budget)), micro-batches per
epoch, length mixing (share of length variance explained by batch membership; low = i.i.d.)
and planning seconds. Without --lengths or --data it plans the built-in seed-like
distribution (902,000 samples shaped like the seed run's data set).

Examples:
  python launch/plan_batches.py --token-budget 49152
  python launch/plan_batches.py --data data/store --token-budget 16384 --world-size 8 --json
"""
import argparse
import json
import sys
import time

import numpy as np

from dflash.data.buckets import optimal_buckets, padded_cost, quantile_buckets
from dflash.data.plan_stats import plan_stats
from dflash.data.planner import DEFAULT_WINDOW, LAYOUTS, ORDERS, bucket_edges, check_lengths, plan_batches
from dflash.data.seed_lengths import SEED_BOUNDARIES, SEED_TOKEN_BUDGET, seed_like_lengths
from dflash.errors import UserError, exit_on_user_error
from dflash.options import parse_list


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", help=".npy file of sample lengths")
    src.add_argument("--data", help="token store folder (from launch/prepare_data.py)")
    p.add_argument("--token-budget", type=int, default=SEED_TOKEN_BUDGET,
                   help="tokens per micro-batch (default %(default)s)")
    p.add_argument("--world-size", type=int, default=1, help="number of ranks (default %(default)s)")
    b = p.add_mutually_exclusive_group()
    b.add_argument("--buckets", type=int, default=6,
                   help="number of optimal buckets for the bucketed order (default %(default)s)")
    b.add_argument("--boundaries", type=lambda text: parse_list(text, "--boundaries", increasing=True, minimum=0),
                   help="bucket boundaries, e.g. 770,1216,1728,2432,3296")
    p.add_argument("--seed", type=int, default=0, help="planner seed (default %(default)s)")
    p.add_argument("--epoch", type=int, default=0, help="epoch to plan (default %(default)s)")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="open bins of the packer (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON keyed '<order>-<layout>' instead of a table")
    return p.parse_args(argv)


def load_lengths(args) -> tuple[np.ndarray, str]:
    if args.lengths:
        try:
            return np.load(args.lengths), args.lengths
        except (OSError, ValueError) as e:
            raise UserError(f"--lengths {args.lengths}: cannot read a .npy array ({e})") from None
    if args.data:
        from dflash.data.token_store import TokenStore

        return TokenStore(args.data).lengths, args.data
    return seed_like_lengths(), "built-in seed-like lengths (902,000 samples)"


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    lengths, source = load_lengths(args)
    lengths = check_lengths(lengths, args.token_budget)
    if args.boundaries is not None:
        edges = bucket_edges(lengths, args.boundaries, args.token_budget)
    else:
        edges = optimal_buckets(lengths, args.buckets, args.token_budget)
    results = {}
    for order in ORDERS:
        for layout in LAYOUTS:
            t0 = time.perf_counter()
            plan = plan_batches(lengths, args.token_budget, order, layout, boundaries=edges, seed=args.seed,
                                epoch=args.epoch, world_size=args.world_size, window=args.window)
            seconds = time.perf_counter() - t0
            batches = [b for rank in plan for b in rank]
            stats = plan_stats(lengths, batches, layout, args.token_budget)
            results[f"{order}-{layout}"] = {**stats, "batches_per_rank": len(plan[0]), "plan_seconds": seconds}
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
                   "lower_bound_batches": -(-int(lengths.sum()) // args.token_budget),
                   **results, "buckets": buckets}, sys.stdout, indent=2)
        print()
        return
    print(f"{source}: {lengths.size:,} samples, {int(lengths.sum()):,} tokens, budget {args.token_budget:,}, "
          f"world size {args.world_size}")
    print(f"bucket boundaries ({buckets['method']}): {edges.tolist()}")
    print(f"lower bound: {-(-int(lengths.sum()) // args.token_budget):,} micro-batches per epoch\n")
    head = (f"{'mode':<18}{'efficiency':>11}{'fill':>9}{'batches':>10}{'per rank':>10}{'smp/batch':>10}"
            f"{'len R2':>8}{'plan s':>8}")
    print(head)
    print("-" * len(head))
    for mode, r in results.items():
        print(f"{mode:<18}{r['efficiency']:>10.2%}{r['fill']:>9.2%}{r['batches']:>10,}{r['batches_per_rank']:>10,}"
              f"{r['samples_per_batch']:>10.1f}{r['length_r2']:>8.3f}{r['plan_seconds']:>8.3f}")
    if tuple(edges.tolist()) != SEED_BOUNDARIES and args.boundaries is None and not (args.lengths or args.data):
        print(f"\n(the seed's hand-picked boundaries were {list(SEED_BOUNDARIES)}; try --boundaries to compare)")


if __name__ == "__main__":
    main()
