"""Anchor sampling and the per-block tensors of the DFlash training layout.

A block anchored at position a of a sample holds [token a, mask x (B-1)] at positions
a .. a+B-1; its slot k (k >= 1) is scored against the data token at a+k (same-position labels).
Anchors are drawn per sample from a generator seeded by (seed, epoch, sample_id), so a resumed
run, another rank or another batch composition redraws exactly the same anchors.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from dflash.data.batch import PackedBatch, PaddedBatch
from dflash.data.supervision import candidate_positions, min_supervised


@dataclass
class Anchors:
    """Which blocks a packed micro-batch trains on (built on the CPU, moved once)."""

    block_seq: torch.Tensor  # (NB,) int32: sample (row of cu_seqlens) of each block
    block_anchor: torch.Tensor  # (NB,) int32: anchor position inside that sample
    block_size: int
    num_skipped: int  # samples with fewer than 2*B supervised tokens (or no anchor candidate)

    @property
    def num_blocks(self) -> int:
        return int(self.block_seq.numel())

    def to(self, device, non_blocking: bool = False) -> Anchors:
        return Anchors(
            self.block_seq.to(device, non_blocking=non_blocking),
            self.block_anchor.to(device, non_blocking=non_blocking),
            self.block_size,
            self.num_skipped,
        )


def anchor_rng(seed: int, epoch: int, sample_id: int) -> np.random.Generator:
    """The generator of one sample's anchors in one epoch."""
    return np.random.default_rng([int(seed), int(epoch), int(sample_id)])


DEFAULT_NUM_ANCHORS = 512  # anchors drawn per sample (the paper's), the default of --num-anchors and the plans


def sample_anchors(
    loss_mask: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    sample_ids: torch.Tensor,
    *,
    block_size: int,
    num_anchors: int = DEFAULT_NUM_ANCHORS,
    seed: int,
    epoch: int,
) -> Anchors:
    """Draw the anchors of every sample of a packed micro-batch.

    Args:
        loss_mask: (T,) bool, supervised tokens of the packed micro-batch (moved to the CPU
            here if needed: draw them in the data loader to avoid that sync).
        cu_seqlens_cpu: (S+1,) int sample boundaries, on the CPU.
        sample_ids: (S,) int index of each sample in the token store (the RNG key).
        block_size: B.
        num_anchors: at most this many anchors per sample (drawn without replacement).
        seed, epoch: the planner's seed and the epoch; anchors are redrawn every epoch.

    Candidates and the fewest supervised tokens a sample needs (2*B) follow `dflash.data.supervision`.
    A sample with fewer supervised tokens, or without a candidate, is skipped and
    counted. Anchors of a sample are sorted; blocks may overlap.

    Returns:
        Anchors on the CPU.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    lm = loss_mask.detach().to("cpu", torch.bool).numpy()
    bounds = cu_seqlens_cpu.tolist()
    ids = sample_ids.detach().cpu().tolist()
    seqs, anchors, skipped = [], [], 0
    for s, (bos, eos) in enumerate(pairwise(bounds)):
        m = lm[bos:eos]
        if int(m.sum()) < min_supervised(block_size):
            skipped += 1
            continue
        candidates = candidate_positions(m)
        if candidates.size == 0:
            skipped += 1
            continue
        n = min(num_anchors, candidates.size)
        chosen = np.sort(anchor_rng(seed, epoch, ids[s]).choice(candidates, size=n, replace=False))
        anchors.append(chosen)
        seqs.append(np.full(n, s))
    if anchors:
        block_anchor = torch.from_numpy(np.concatenate(anchors).astype(np.int32))
        block_seq = torch.from_numpy(np.concatenate(seqs).astype(np.int32))
    else:
        block_anchor = torch.zeros(0, dtype=torch.int32)
        block_seq = torch.zeros(0, dtype=torch.int32)
    return Anchors(block_seq, block_anchor, block_size, skipped)


@dataclass
class BlockTensors:
    """Inputs and labels of all blocks, flattened block-major (rows [j*B, (j+1)*B) = block j)."""

    input_ids: torch.Tensor  # (NB*B,) int64: anchor token, then mask tokens
    position_ids: torch.Tensor  # (NB*B,) int64: anchor + k
    labels: torch.Tensor  # (NB, B-1) int64: data token at anchor + k, k = 1..B-1
    label_valid: torch.Tensor  # (NB, B-1) bool: anchor + k inside the sample and supervised


def block_tensors(anchors: Anchors, batch: PackedBatch, mask_token_id: int) -> BlockTensors:
    """Gather block inputs and same-position labels on the batch's device (no host sync)."""
    device = batch.input_ids.device
    B = anchors.block_size
    seq = anchors.block_seq.to(device).long()
    anchor = anchors.block_anchor.to(device).long()
    cu = batch.cu_seqlens.to(device).long()
    start, length = cu[seq], cu[seq + 1] - cu[seq]
    k = torch.arange(B, device=device)
    ids = torch.full((seq.numel(), B), mask_token_id, dtype=torch.long, device=device)
    ids[:, 0] = batch.input_ids[start + anchor]
    rel = anchor[:, None] + k[None, 1:]  # (NB, B-1) label positions inside the sample
    inside = rel < length[:, None]
    flat = (start[:, None] + rel).clamp(max=batch.input_ids.numel() - 1)
    labels = batch.input_ids[flat]
    valid = inside & batch.loss_mask[flat].bool()
    return BlockTensors(
        input_ids=ids.reshape(-1),
        position_ids=(anchor[:, None] + k[None, :]).reshape(-1),
        labels=labels,
        label_valid=valid,
    )


def to_packed(batch: PackedBatch | PaddedBatch) -> PackedBatch:
    """The packed layout of a micro-batch (a padded one loses its padding, order kept)."""
    if isinstance(batch, PackedBatch):
        return batch
    lengths = batch.lengths.cpu().long()
    real = batch.attention_mask.bool()
    # Rows are right-padded, so row-major selection keeps each sample contiguous and in order.
    cu_cpu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu_cpu[1:] = torch.cumsum(lengths, 0)
    return PackedBatch(
        input_ids=batch.input_ids[real],
        loss_mask=batch.loss_mask[real],
        position_ids=batch.position_ids[real],
        cu_seqlens=cu_cpu.to(batch.input_ids.device),
        cu_seqlens_cpu=cu_cpu,
        max_seqlen=int(lengths.max()) if lengths.numel() else 0,
        sample_ids=batch.sample_ids,
    )
