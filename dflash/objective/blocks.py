"""The blocks of a micro-batch: what the drafter runs and the loss scores, built once by the loader.

A block anchored at position a of a sample holds [token a, mask x (B-1)] at positions a .. a+B-1;
slot k (k >= 1) is scored against the data token at a+k with the slot weight w_k where that label
lies inside the sample and is supervised. `Blocks` carries all of it, so the drafter's forward
only reads it (`DFlashDrafter.forward(batch, features, blocks)` -> hidden states) and every loss
term (`dflash.objective.loss`) reads the same labels, validity and weights.

    blocks = draw_blocks(batch, block_size=B, num_anchors=512, mask_token_id=m, weights=w, seed=s, epoch=e)
    hidden = drafter(batch, features, blocks.to(device))
    out = BlockLoss(chunk_rows)(hidden, blocks, drafter.lm_head)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash.data.batch import PackedBatch, PaddedBatch
from dflash.objective.anchors import Anchors, block_tensors, sample_anchors, to_packed


@dataclass
class Blocks:
    """The blocks of one packed micro-batch, flattened block-major (rows [j*B, (j+1)*B) = block j).

    A micro-batch without any block holds one zero-weight stand-in block (`num_blocks` 0), so that
    every rank runs the same modules (ZeRO-3) and the loss still has a graph.
    """

    anchors: Anchors  # block ids (sample of each block) and anchor positions, as the attention reads them
    input_ids: torch.Tensor  # (NB*B,) int64: anchor token, then mask tokens
    position_ids: torch.Tensor  # (NB*B,) int64: anchor + k
    labels: torch.Tensor  # (NB, B-1) int64: data token at anchor + k, k = 1..B-1
    valid: torch.Tensor  # (NB, B-1) bool: the label is inside the sample and supervised (False in a stand-in)
    weights: torch.Tensor  # (NB, B-1) float32: slot weight w_k where valid, else 0
    num_blocks: int  # real blocks (0 for a micro-batch whose tensors hold only the stand-in)

    @property
    def block_size(self) -> int:
        return self.anchors.block_size

    @property
    def num_skipped(self) -> int:
        """Samples without a block: too few supervised tokens (`dflash.data.supervision`)."""
        return self.anchors.num_skipped

    @classmethod
    def build(cls, anchors: Anchors, batch: PackedBatch, mask_token_id: int, slot_weights: torch.Tensor) -> Blocks:
        """The blocks of `anchors` on the batch's device (no host sync); slot_weights (B-1,) float32."""
        num_blocks = anchors.num_blocks
        if num_blocks == 0:
            anchors = Anchors(torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                              anchors.block_size, anchors.num_skipped)
        device = batch.input_ids.device
        anchors = anchors.to(device)
        t = block_tensors(anchors, batch, mask_token_id)
        valid = t.label_valid if num_blocks else torch.zeros_like(t.label_valid)
        weights = slot_weights.to(device)[None, :] * valid
        return cls(anchors, t.input_ids, t.position_ids, t.labels, valid, weights, num_blocks)

    @property
    def weight_sum(self) -> torch.Tensor:
        """Sum of the loss weights (the step's normaliser adds these up)."""
        return self.weights.sum()

    def rows(self, num_samples: int) -> np.ndarray:
        """(S,) drafter rows (block_size x blocks) of each sample: what the cost model prices."""
        seq = self.anchors.block_seq[:self.num_blocks].cpu().numpy()
        return np.bincount(seq, minlength=num_samples) * self.block_size

    def _map(self, fn) -> Blocks:
        a = self.anchors
        return Blocks(Anchors(fn(a.block_seq), fn(a.block_anchor), a.block_size, a.num_skipped), fn(self.input_ids),
                      fn(self.position_ids), fn(self.labels), fn(self.valid), fn(self.weights), self.num_blocks)

    def to(self, device, non_blocking: bool = False) -> Blocks:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Blocks:
        return self._map(lambda t: t.pin_memory())


def draw_blocks(batch: PackedBatch | PaddedBatch, *, block_size: int, num_anchors: int, mask_token_id: int,
                slot_weights: torch.Tensor, seed: int, epoch: int) -> Blocks:
    """Draw the anchors of a micro-batch (`sample_anchors`, keyed by seed, epoch and sample) and build
    its blocks, on the batch's device: in the data loader, on the CPU, so the forward never syncs."""
    packed = to_packed(batch)
    anchors = sample_anchors(packed.loss_mask, packed.cu_seqlens_cpu, packed.sample_ids, block_size=block_size,
                             num_anchors=num_anchors, seed=seed, epoch=epoch)
    return Blocks.build(anchors, packed, mask_token_id, slot_weights)


def block_scorer(model, loss, lm_head: torch.Tensor, *, mask_token_id: int, slot_weights: torch.Tensor):
    """`forward(batch, features, anchors, temperatures=()) -> LossOutput` of the blocks at `anchors`, as
    the eval walk calls it (`dflash.decoding.acceptance.score_and_walk`): model is the drafter or its
    DeepSpeed engine, loss a `BlockLoss`."""

    def forward(batch, features, anchors: Anchors, temperatures=()):
        blocks = Blocks.build(anchors, to_packed(batch), mask_token_id, slot_weights)
        return loss(model(batch, features, blocks), blocks, lm_head, temperatures)

    return forward
