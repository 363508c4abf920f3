"""Micro-batch collation: sample indices from the planner -> a PackedBatch or PaddedBatch."""
from __future__ import annotations

import numpy as np
import torch

from dflash.data.batch import PackedBatch, PaddedBatch


def collate_packed(store, indices) -> PackedBatch:
    """Concatenate the samples into flat rows; positions restart at 0 for every sample."""
    indices = np.asarray(indices, dtype=np.int64)
    ids, masks = zip(*(store[i] for i in indices), strict=True)
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    cu = np.zeros(len(ids) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    starts = np.repeat(cu[:-1].astype(np.int64), lengths)
    position_ids = np.arange(int(cu[-1]), dtype=np.int64) - starts
    cu_t = torch.from_numpy(cu)
    return PackedBatch(
        input_ids=torch.from_numpy(np.concatenate(ids).astype(np.int64)),
        loss_mask=torch.from_numpy(np.concatenate(masks)),
        position_ids=torch.from_numpy(position_ids),
        cu_seqlens=cu_t,
        cu_seqlens_cpu=cu_t.clone(),
        max_seqlen=int(lengths.max()),
        sample_ids=torch.from_numpy(indices),
    )


def collate_padded(store, indices, pad_id: int = 0) -> PaddedBatch:
    """Right-pad the samples to the longest one (count x longest tokens computed)."""
    indices = np.asarray(indices, dtype=np.int64)
    ids, masks = zip(*(store[i] for i in indices), strict=True)
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    longest = int(lengths.max())
    input_ids = np.full((len(ids), longest), pad_id, dtype=np.int64)
    loss_mask = np.zeros((len(ids), longest), dtype=np.bool_)
    for row, (x, m) in enumerate(zip(ids, masks, strict=True)):
        input_ids[row, : len(x)] = x
        loss_mask[row, : len(m)] = m
    attention_mask = np.arange(longest)[None, :] < lengths[:, None]
    position_ids = np.where(attention_mask, np.arange(longest)[None, :], 0)
    return PaddedBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        loss_mask=torch.from_numpy(loss_mask),
        position_ids=torch.from_numpy(position_ids),
        lengths=torch.from_numpy(lengths),
        sample_ids=torch.from_numpy(indices),
    )


def collate(store, indices, layout: str, pad_id: int = 0):
    return collate_packed(store, indices) if layout == "packed" else collate_padded(store, indices, pad_id)
