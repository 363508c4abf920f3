"""Noise augmentation of the tapped target features (--feature-noise): Gaussian noise of a given std
added to the features the drafter reads in training, as vLLM speculators does to its hidden states
(std 0.05 there), so that the drafter does not rely on features it will never see exactly.

The noise of a sample depends only on (seed, epoch, sample id), never on the micro-batch it lands
in, the rank or the step: a run is reproducible, a resume exact, and two layouts of the same data
see the same noise.
"""
from __future__ import annotations

import hashlib

import torch


def sample_seed(seed: int, epoch: int, sample_id: int) -> int:
    """A 63-bit generator seed of (seed, epoch, sample), independent across the three."""
    digest = hashlib.blake2b(f"feature-noise:{seed}:{epoch}:{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class FeatureNoise:
    """`noise(features, packed_batch, epoch)` -> features + std x N(0, 1), drawn per sample."""

    def __init__(self, std: float, seed: int):
        if not std >= 0:
            raise ValueError(f"the feature noise std must be >= 0, got {std}")
        self.std, self.seed = float(std), int(seed)

    def __call__(self, features: torch.Tensor, batch, epoch: int) -> torch.Tensor:
        """features (tokens, K*H) in the packed order of `batch` (a PackedBatch: cu_seqlens_cpu, sample_ids)."""
        if not self.std:
            return features
        bounds = batch.cu_seqlens_cpu.tolist()
        noisy = features.clone()
        for i, sample in enumerate(batch.sample_ids.tolist()):
            # on the features' device (its own generator: the same numbers on every device of a kind)
            g = torch.Generator(device=features.device).manual_seed(sample_seed(self.seed, epoch, sample))
            lo, hi = bounds[i], bounds[i + 1]
            noise = torch.randn(hi - lo, features.shape[1], generator=g, device=features.device)
            noisy[lo:hi] += (noise * self.std).to(features.dtype)
        return noisy
