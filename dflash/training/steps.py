"""Batch plan -> optimizer steps -> collated micro-batches, prefetched by loader workers.

An optimizer step covers a fixed number of real tokens per rank (`step_tokens`): micro-steps
are added until the ranks' average real tokens reach it, so padded layouts take more
micro-batches per step than packed ones and every mode sees the same tokens per update. Step
boundaries come from the plan alone, so every rank computes the same ones without talking
(ZeRO-3 needs the same number of forward passes everywhere).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from dflash.data.batch import PackedBatch, PaddedBatch
from dflash.data.collate import collate
from dflash.data.cost import batch_features
from dflash.objective.anchors import to_packed
from dflash.objective.blocks import Blocks, draw_blocks
from dflash.objective.loss import slot_weights


def step_ranges(plan: list, lengths: np.ndarray, step_tokens: int) -> list[tuple[int, int]]:
    """Cut the micro-steps of one epoch's plan (`plan[rank][i]`) into optimizer steps.

    Returns `[(first, end), ...]` micro-step ranges; the last step of an epoch may be short.
    """
    world_size, n = len(plan), len(plan[0])
    tokens = np.zeros(n)
    for rank_batches in plan:
        sizes = [len(b) for b in rank_batches]
        per_sample = lengths[np.concatenate(rank_batches)]
        tokens += np.add.reduceat(per_sample, np.concatenate([[0], np.cumsum(sizes)[:-1]]))
    tokens /= world_size
    ranges, start, acc = [], 0, 0.0
    for i in range(n):
        acc += tokens[i]
        if acc >= step_tokens:
            ranges.append((start, i + 1))
            start, acc = i + 1, 0.0
    if start < n:
        ranges.append((start, n))
    return ranges


@dataclass
class MicroBatch:
    batch: PackedBatch | PaddedBatch
    blocks: Blocks  # drawn and built here so the forward never syncs for them
    weight_sum: float  # sum of loss weights of its scored slots (for the step's normaliser)
    real_tokens: int
    computed_tokens: int
    cost_features: np.ndarray  # (7,) `dflash.data.cost.batch_features`: what the cost model prices

    def pin_memory(self) -> MicroBatch:
        return dataclasses.replace(self, batch=self.batch.pin_memory(), blocks=self.blocks.pin_memory())


class MicroBatchMaker:
    """Collates one micro-batch and builds its blocks (runs inside loader workers)."""

    def __init__(self, store_path, layout: str, *, pad_id: int, mask_token_id: int, block_size: int,
                 num_anchors: int, gamma: float, seed: int, window: int = 0):
        self.store_path, self.layout, self.pad_id = store_path, layout, pad_id
        self.mask_token_id, self.block_size, self.num_anchors = mask_token_id, block_size, num_anchors
        self.weights = slot_weights(block_size, gamma)
        self.seed = seed
        self.window = window  # the target's sliding window, for the cost features (0: none)
        self._store = None  # opened lazily: each worker maps the files itself

    @property
    def store(self):
        if self._store is None:
            from dflash.data.synthetic import open_store

            self._store = open_store(self.store_path)  # a folder (mapped per worker) or a SyntheticStore
        return self._store

    def __getstate__(self):
        return {**self.__dict__, "_store": None}

    def __call__(self, indices: np.ndarray, epoch: int) -> MicroBatch:
        batch = collate(self.store, indices, self.layout, self.pad_id)
        packed = to_packed(batch)
        blocks = draw_blocks(packed, block_size=self.block_size, num_anchors=self.num_anchors,
                             mask_token_id=self.mask_token_id, slot_weights=self.weights, seed=self.seed, epoch=epoch)
        lengths = np.diff(packed.cu_seqlens_cpu.numpy()).astype(np.int64)
        if self.layout == "padded":  # the target runs every sample at the longest length
            lengths = np.full_like(lengths, lengths.max())
        features = batch_features(lengths, blocks.rows(lengths.size), [np.arange(lengths.size)], self.window)[0]
        return MicroBatch(batch, blocks, float(blocks.weight_sum), batch.num_tokens, batch.computed_tokens, features)


class _EpochItems(torch.utils.data.Dataset):
    def __init__(self, maker: MicroBatchMaker, batches: list, epoch: int, start: int):
        self.maker, self.batches, self.epoch, self.start = maker, batches, epoch, start

    def __len__(self):
        return len(self.batches) - self.start

    def __getitem__(self, i):
        return self.maker(self.batches[self.start + i], self.epoch)


def micro_batches(maker: MicroBatchMaker, batches: list, epoch: int, start: int, *, num_workers: int, pin_memory: bool):
    """Iterate this rank's micro-batches of one epoch from micro-step `start`, collated ahead."""
    loader = torch.utils.data.DataLoader(
        _EpochItems(maker, batches, epoch, start), batch_size=None, shuffle=False, num_workers=num_workers,
        pin_memory=pin_memory, prefetch_factor=4 if num_workers else None, persistent_workers=False,
    )
    return iter(loader)
