"""Length-bucket boundaries for bucketed batching.

Boundaries are written as in the seed run, `[0, b1, ..., max]`: bucket i holds the samples
with `b_i < length <= b_{i+1}`.
"""
from __future__ import annotations

import numpy as np

from dflash.data import packing
from dflash.errors import UserError


def _check(lengths, num_buckets: int, token_budget: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or lengths.size == 0:
        raise UserError("bucket boundaries need a non-empty 1-D array of lengths")
    if num_buckets < 1:
        raise UserError(f"--buckets must be >= 1, got {num_buckets}")
    longest = int(lengths.max())
    if longest > token_budget:
        i = int(lengths.argmax())
        raise UserError(f"sample {i} has {longest} tokens, more than the token budget {token_budget}")
    return lengths


def optimal_buckets(lengths, num_buckets: int, token_budget: int) -> np.ndarray:
    """Boundaries minimising the padded tokens of padded bucketed batching, exactly.

    The cost of a bucket is its sample count times its longest length (every sample padded to
    the bucket's longest), minimised over all contiguous partitions of the sorted distinct
    lengths by dynamic programming (`packing.optimal_partition`).
    """
    lengths = _check(lengths, num_buckets, token_budget)
    values, counts = np.unique(lengths, return_counts=True)
    ends = packing.optimal_partition(values, counts, num_buckets)
    return np.concatenate([[0], values[ends]]).astype(np.int64)


def quantile_buckets(lengths, num_buckets: int, token_budget: int) -> np.ndarray:
    """The usual heuristic: boundaries at equal-count quantiles of the lengths."""
    lengths = _check(lengths, num_buckets, token_budget)
    qs = np.quantile(lengths, np.linspace(0, 1, num_buckets + 1)[1:-1], method="higher")
    inner = np.unique(qs.astype(np.int64))
    return np.concatenate([[0], inner[inner < lengths.max()], [lengths.max()]]).astype(np.int64)


def padded_cost(lengths, boundaries) -> int:
    """Tokens computed when every sample is padded to its bucket's upper boundary."""
    lengths = np.asarray(lengths, dtype=np.int64)
    edges = np.asarray(boundaries, dtype=np.int64)
    bucket = np.searchsorted(edges[1:-1], lengths, side="left")
    return int(np.bincount(bucket, minlength=len(edges) - 1) @ edges[1:])
