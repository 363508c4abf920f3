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
