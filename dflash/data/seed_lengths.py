"""Seed-like sample lengths for defaults, demos and benchmarks (users have no shared data).

The seed run trained on 902,000 samples of at most 8,192 tokens with six length buckets
[0, 770, 1216, 1728, 2432, 3296, 8192]. Taking those inner boundaries as sextiles, with a
log-linear inverse CDF between them (48 tokens at the bottom), gives a distribution whose
padded batching reproduces the seed's efficiencies (sorted 99.99%, shuffle 43.1%, buckets 78.5%).
"""
from __future__ import annotations

import numpy as np

SEED_NUM_SAMPLES = 902_000
SEED_TOKEN_BUDGET = 49_152
SEED_BOUNDARIES = (0, 770, 1216, 1728, 2432, 3296, 8192)
_QUANTILES = np.linspace(0.0, 1.0, 7)
_LENGTH_AT_QUANTILE = np.log([48, 770, 1216, 1728, 2432, 3296, 8192])


def seed_like_lengths(n: int = SEED_NUM_SAMPLES, seed: int = 0) -> np.ndarray:
    """`(n,)` int32 lengths drawn from the seed-like distribution (deterministic in `seed`)."""
    u = np.random.default_rng(seed).random(n)
    return np.clip(np.exp(np.interp(u, _QUANTILES, _LENGTH_AT_QUANTILE)).astype(np.int32), 16, 8192)
