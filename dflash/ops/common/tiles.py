"""Tile lists: which tiles of a packed batch exist, built with torch ops on the batch's device.

Kernels launch one program per listed tile, so a long sample never sizes the grid for the
others and lengths never become kernel arguments (nothing recompiles when they change).
Without a CPU copy of cu_seqlens the count of real tiles is not known on the host; the list is
then padded to an upper bound with sentinel entries (sample -1) that the kernels skip, and at
most one sentinel per sample is launched. Lists are heaviest-first so that the long programs
start early and the short ones fill the tail (the same schedule for sorted and shuffled
batches).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

_SHIFT = 32  # sample index above, position below, in one sortable int64 key


def cdiv(a, b):
    return (a + b - 1) // b


class TensorKeyedCache:
    """Remembers the last few results computed from given tensors (same objects, unchanged).

    Every layer of a model calls the op with the same cu_seqlens, so the tile lists are built
    once per batch. Entries hold references to their tensors, so an id cannot be reused while
    its entry lives.
    """

    def __init__(self, size: int = 8):
        self.size = size
        self.entries: OrderedDict = OrderedDict()

    def get(self, tensors: tuple, params: tuple, build: Callable):
        key = (tuple(id(t) for t in tensors), tuple(t._version for t in tensors), params)
        hit = self.entries.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], tensors, strict=True)):
            self.entries.move_to_end(key)
            return hit[1]
        value = build()
        self.entries[key] = (tensors, value)
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value


TILE_CACHE = TensorKeyedCache()


def longest_sample(cu_seqlens_cpu: torch.Tensor) -> int:
    """Rows of the longest sample of a host copy of cu_seqlens (0 without samples)."""
    return int((cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]).max()) if cu_seqlens_cpu.numel() > 1 else 0


def sequence_tiles(cu_seqlens: torch.Tensor, block: int, total: int, causal: bool,
                   cu_seqlens_cpu: torch.Tensor | None = None) -> torch.Tensor:
    """(n, 2) int32 rows (sample, tile index) covering every sample in `block`-row tiles.

    Ordered by work: for causal attention tile t of a sample sees t+1 key tiles, otherwise a
    tile sees its whole sample. n is exact with cu_seqlens_cpu, else an upper bound from the
    `total` rows alone (a caller's max_seqlen is not trusted: too small a bound would drop
    tiles), padded with (-1, 0) rows at the end.
    """
    num_seqs = cu_seqlens.numel() - 1
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ntiles = cdiv(lens, block)
    if cu_seqlens_cpu is not None:
        n = int(cdiv(cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1], block).sum())
    else:
        n = min(cdiv(total, block) + num_seqs, num_seqs * cdiv(total, block))
    ends = torch.cumsum(ntiles, 0)
    k = torch.arange(n, device=cu_seqlens.device)
    seq = torch.searchsorted(ends, k, right=True)  # == num_seqs past the last real tile
    real = seq < num_seqs
    seq_c = seq.clamp(max=max(num_seqs - 1, 0))
    tile = k - (ends - ntiles)[seq_c]
    work = torch.where(real, tile + 1 if causal else ntiles[seq_c], -1)
    order = torch.argsort(work, descending=True, stable=True)
    seq = torch.where(real, seq, -1)
    tile = torch.where(real, tile, 0)
    return torch.stack([seq[order], tile[order]], 1).to(torch.int32).contiguous()


def block_groups(block_seq: torch.Tensor, block_anchor: torch.Tensor, num_seqs: int, per_group: int):
    """Groups of up to `per_group` blocks of one sample with neighbouring anchors.

    Blocks are sorted by (sample, anchor) and cut into groups per sample, so a group's rows
    share one context and their anchors differ little (few partly visible context tiles).
    Returns
      blocks (G, per_group) int32: block ids, -1 where a group is not full;
      seq (G,) int32: the group's sample, -1 for sentinel groups past the real ones;
      amin, amax (G,) int32: smallest and largest anchor of the group;
      order (G,) int32: launch order, largest amax (most work) first.
    G = NB // per_group + num_seqs bounds the real count without reading block_seq on the host;
    real groups come first, in (sample, anchor) order.
    """
    device = block_seq.device
    nb = block_seq.numel()
    seqs = block_seq.long()
    anchors = block_anchor.long()
    order = torch.argsort((seqs << _SHIFT) + anchors, stable=True)
    seq_sorted, anchor_sorted = seqs[order], anchors[order]
    # Not torch.bincount: on CUDA it reads the largest value back to the host.
    counts = torch.zeros(num_seqs, dtype=torch.long, device=device).index_add_(0, seqs, torch.ones_like(seqs))
    ngroups = cdiv(counts, per_group)
    first_group = torch.cumsum(ngroups, 0) - ngroups
    first_block = torch.cumsum(counts, 0) - counts
    rank = torch.arange(nb, device=device) - first_block[seq_sorted]
    gid = first_group[seq_sorted] + rank // per_group
    num_groups = min(nb, nb // per_group + num_seqs)
    blocks = torch.full((num_groups, per_group), -1, dtype=torch.long, device=device)
    blocks[gid, rank % per_group] = order
    seq = torch.full((num_groups,), -1, dtype=torch.long, device=device).scatter(0, gid, seq_sorted)
    big = torch.iinfo(torch.int32).max
    amin = torch.full((num_groups,), big, dtype=torch.long, device=device)
    amin = amin.scatter_reduce(0, gid, anchor_sorted, "amin")
    amax = torch.zeros(num_groups, dtype=torch.long, device=device).scatter_reduce(0, gid, anchor_sorted, "amax")
    launch = torch.argsort(torch.where(seq >= 0, amax, -1), descending=True, stable=True)
    return (blocks.to(torch.int32).contiguous(), seq.to(torch.int32), amin.to(torch.int32),
            amax.to(torch.int32), launch.to(torch.int32))


def context_group_ranges(ctx_tiles: torch.Tensor, block: int, group_seq: torch.Tensor,
                         group_amin: torch.Tensor, group_amax: torch.Tensor, num_seqs: int,
                         window: int | None = None) -> torch.Tensor:
    """For each context tile (sample s, keys [c0, c0+block)), the groups that see it.

    Returns (n, 3) int32 (lo, full, end): groups [lo, full) see part of the tile (masking
    needed), groups [full, end) see all of it, the others nothing. Relies on the groups being
    in (sample, anchor) order, which makes both keys below sorted. With a sliding `window` (a
    row at position p sees keys > p - window) groups anchored at c0 + block + window - 1 or later
    see nothing of the tile, and every group that sees it is masked (full = end).
    """
    seq = group_seq.long()
    seq = torch.where(seq >= 0, seq, num_seqs)  # sentinels sort last
    key_min = (seq << _SHIFT) + group_amin.long()
    key_max = (seq << _SHIFT) + group_amax.long()
    s = ctx_tiles[:, 0].long()
    c0 = ctx_tiles[:, 1].long() * block
    base = s << _SHIFT
    lo = torch.searchsorted(key_max, base + c0, right=True)
    end = torch.searchsorted(key_min, (s + 1) << _SHIFT)
    if window is None:
        full = torch.searchsorted(key_min, base + c0 + block)
    else:
        end = torch.minimum(end, torch.searchsorted(key_min, base + c0 + block + window - 1))
        full = end
    empty = s < 0  # sentinel tiles see nothing
    ranges = torch.stack([lo, full, end], 1).masked_fill(empty[:, None], 0)
    return ranges.to(torch.int32).contiguous()
