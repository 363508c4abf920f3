"""What a batch plan costs and how random it is: the numbers `launch/plan_batches.py` prints."""
from __future__ import annotations

import numpy as np


def plan_stats(lengths, batches, layout: str, token_budget: int) -> dict:
    """Padding efficiency, budget fill, batch count and length mixing of one epoch's batches.

    efficiency  real tokens / computed tokens (padded: count x longest; packed: real tokens)
    fill        real tokens / (micro-batches x budget)
    length_r2   share of the length variance explained by batch membership: about
                (samples per batch)^-1 for i.i.d. batches, near 1 when batches are length-sorted
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
    flat = np.concatenate(batches)
    batch_of = np.repeat(np.arange(len(batches)), sizes)
    sums = np.bincount(batch_of, weights=lengths[flat], minlength=len(batches))
    real = float(sums.sum())
    if layout == "padded":
        longest = np.maximum.reduceat(lengths[flat], np.concatenate([[0], np.cumsum(sizes)[:-1]]))
        computed = float((sizes * longest).sum())
    else:
        computed = real
    means = sums / sizes
    total_var = lengths[flat].var()
    between = float(np.sum(sizes * (means - lengths[flat].mean()) ** 2) / flat.size)
    return {
        "efficiency": real / computed,
        "fill": real / (len(batches) * token_budget),
        "batches": int(len(batches)),
        "samples_per_batch": float(sizes.mean()),
        "length_r2": between / total_var if total_var > 0 else 0.0,
    }


def length_r2(lengths, groups) -> float:
    """Share of the length variance of the samples explained by group membership (groups are
    lists of sample indices: micro-batches, or all micro-batches of one step)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    sizes = np.fromiter((len(g) for g in groups), dtype=np.int64, count=len(groups))
    values = lengths[np.concatenate(groups)]
    means = np.add.reduceat(values, np.concatenate([[0], np.cumsum(sizes)[:-1]])) / sizes
    total = values.var()
    return float(np.sum(sizes * (means - values.mean()) ** 2) / values.size / total) if total > 0 else 0.0


def dealing_stats(plan, model, rows, layout: str, lengths, micro_batches_per_step: int) -> dict:
    """How evenly a plan deals work to the ranks, and how mixed its steps are.

    plan: `plan[rank][i]` sample indices; model: a `dflash.data.cost.CostModel` (padded
    micro-batches cost as count x longest tokens); a step is `micro_batches_per_step`
    consecutive indices on every rank (the last one may be shorter).

    balance_micro  mean over indices i of mean_r cost[r, i] / max_r cost[r, i]: the share of
                   time not spent waiting when ranks synchronise at every forward (ZeRO-3)
    balance_step   the same over each rank's summed cost of a step (ZeRO-1/2 wait once a step)
    rows_p50/max   drafter rows per micro-batch
    step_length_r2 length mixing with all micro-batches of a step as one group
    """
    from dflash.data.cost import batch_features

    lengths = np.asarray(lengths, dtype=np.int64)
    world, count = len(plan), len(plan[0])
    batches = [plan[r][i] for i in range(count) for r in range(world)]  # index-major
    effective = lengths
    if layout == "padded":
        effective = lengths.copy()
        for b in batches:
            effective[b] = lengths[b].max()
    cost = (batch_features(effective, rows, batches, model.window) @ model.coefficients()).reshape(count, world)
    k = micro_batches_per_step
    starts = np.arange(0, count, k)
    step_cost = np.add.reduceat(cost, starts, axis=0)
    batch_rows = np.fromiter((rows[b].sum() for b in batches), dtype=np.int64, count=len(batches))
    steps = [np.concatenate(batches[s * world:(s + k) * world]) for s in starts]
    return {
        "balance_micro": float(np.mean(cost.mean(axis=1) / cost.max(axis=1))),
        "balance_step": float(np.mean(step_cost.mean(axis=1) / step_cost.max(axis=1))),
        "rows_p50": float(np.median(batch_rows)),
        "rows_max": int(batch_rows.max()),
        "step_length_r2": length_r2(lengths, steps),
    }
