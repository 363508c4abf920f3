"""Collated micro-batches: the one hand-over format from the data side to the models.

Packed layout (no padding): all samples of the micro-batch concatenated into flat rows with the
varlen calling convention of `dflash.ops` (`cu_seqlens` int32 `(S+1,)`, Python-int `max_seqlen`).
Padded layout: `(S, L)` rows padded on the right to the longest sample, with an attention mask.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch


class _Batch:
    """Moving a batch: every tensor but the one kept on the host for launches without a sync."""

    _host_only = ""

    def _map(self, fn):
        return type(self)(**{f.name: fn(v) if isinstance(v, torch.Tensor) and f.name != self._host_only else v
                             for f in fields(self) for v in [getattr(self, f.name)]})

    def to(self, device, non_blocking: bool = False):
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self):
        """Called by the DataLoader's pinning thread, so host-to-device copies can overlap compute."""
        return self._map(torch.Tensor.pin_memory)


@dataclass
class PackedBatch(_Batch):
    input_ids: torch.Tensor  # (T,) int64, samples concatenated
    loss_mask: torch.Tensor  # (T,) bool, True on assistant (supervised) tokens
    position_ids: torch.Tensor  # (T,) int64, restarting at 0 for every sample
    cu_seqlens: torch.Tensor  # (S+1,) int32, sample i is rows [cu[i], cu[i+1])
    cu_seqlens_cpu: torch.Tensor  # the same on the CPU, so launchers never sync with the device
    max_seqlen: int  # longest sample, a Python int
    sample_ids: torch.Tensor  # (S,) int64, index of each sample in the token store

    layout = "packed"
    _host_only = "cu_seqlens_cpu"

    @property
    def num_tokens(self) -> int:
        """Real tokens (= computed tokens: nothing is padded)."""
        return int(self.cu_seqlens_cpu[-1])

    @property
    def computed_tokens(self) -> int:
        return self.num_tokens



@dataclass
class PaddedBatch(_Batch):
    input_ids: torch.Tensor  # (S, L) int64, right-padded with pad_id
    attention_mask: torch.Tensor  # (S, L) bool, True on real tokens
    loss_mask: torch.Tensor  # (S, L) bool, True on assistant tokens (False on padding)
    position_ids: torch.Tensor  # (S, L) int64, 0..len-1 then 0 on padding
    lengths: torch.Tensor  # (S,) int64 on the CPU
    sample_ids: torch.Tensor  # (S,) int64

    layout = "padded"
    _host_only = "lengths"

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def computed_tokens(self) -> int:
        """count x longest: what a padded forward computes."""
        return int(self.input_ids.shape[0] * self.input_ids.shape[1])
