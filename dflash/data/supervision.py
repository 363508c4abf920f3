"""Which supervised tokens the drafter trains on: the one home of the anchor-candidate rule and of
the rule that a sample needs at least 2 x block_size supervised tokens.

An anchor candidate is a position p whose token and the next one are both supervised (p + 1 inside
the sample): the block anchored there has at least its first label. The anchor sampler draws from
these positions, the eval walk scores a block at each of them, and the stores count them per sample
(`TokenStore.candidates()`, `SyntheticStore.candidates()`) for the cost model and the row budget.
"""
from __future__ import annotations

import numpy as np

MIN_SUPERVISED_BLOCKS = 2  # a sample trains only with at least this many blocks' worth of supervised tokens


def min_supervised(block_size: int) -> int:
    """The fewest supervised tokens a sample needs to be trained on (the paper's 2 x B)."""
    return MIN_SUPERVISED_BLOCKS * block_size


def trainable(supervised, block_size: int) -> np.ndarray:
    """Per sample: whether its supervised token count lets the anchor sampler draw from it."""
    return np.asarray(supervised, dtype=np.int64) >= min_supervised(block_size)


def candidate_positions(mask: np.ndarray) -> np.ndarray:
    """The anchor candidates of one sample's loss mask: positions p with mask[p] and mask[p + 1]."""
    m = np.asarray(mask, dtype=bool)
    return np.flatnonzero(m[:-1] & m[1:])


def candidates_from_supervised(supervised) -> np.ndarray:
    """Anchor candidates of samples with one supervised span: supervised - 1. An upper bound with
    several spans; a store counts them exactly from its loss masks."""
    return np.maximum(np.asarray(supervised, dtype=np.int64) - 1, 0)


def ragged_candidates(column) -> np.ndarray:
    """Anchor candidates of every sample of a pyarrow chunked list column of loss masks (a token
    store's `loss_mask`), in one vectorised pass per chunk of the memory-mapped column."""
    counts = []
    for chunk in column.chunks:
        mask = chunk.values.to_numpy(zero_copy_only=True).astype(bool)
        offsets = chunk.offsets.to_numpy(zero_copy_only=True).astype(np.int64)
        # prefix[k]: adjacent supervised pairs (p, p + 1) with p < k; sample [s, e) has prefix[e-1] - prefix[s]
        prefix = np.concatenate([[0], np.cumsum(mask[:-1] & mask[1:])])
        ends = np.maximum(offsets[1:] - 1, offsets[:-1])
        counts.append(prefix[ends] - prefix[offsets[:-1]] if mask.size else np.zeros(offsets.size - 1, np.int64))
    return np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
