"""Decoding-equivalent acceptance length: a block at every position of each assistant turn, then a walk.

Greedy speculative decoding of a turn starts with the turn's first token (the prefill's output) as
the anchor, drafts one block, accepts the leading draft tokens that equal the target's, adds the
target's next token and anchors the next block there: it spends one target forward per block and
jumps `accepted + 1` tokens. The drafter's block at position a depends only on the tokens and target
features before a (and on a's own token), so scoring a block at EVERY position of a turn once (packed,
in chunks of `max_blocks` blocks) and then walking the positions as decoding does gives exactly the
decoding figure when the turn is the target's own greedy output: `tau = tokens after the first /
blocks walked`. For sampled data the walk follows the data's path, which decoding would not take
where the data differ from the target's argmax, so it is then an estimate.

The same scores give the random-anchor figures in expectation: `anchor_tau` (mean over every anchor
of accepted + 1, which weights easy and hard positions alike and so overstates decoding) and the
per-slot accuracy.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash.data.batch import PackedBatch
from dflash.models.anchors import Anchors

DEFAULT_MAX_BLOCKS = 2048  # blocks per drafter forward: block_size x this many query rows


def turn_spans(loss_mask: np.ndarray, max_turn_tokens: int | None = None) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of supervised tokens (an assistant turn with its end
    marker), cut to its first `max_turn_tokens` tokens when given (the decoding limit)."""
    m = np.concatenate([[0], np.asarray(loss_mask, dtype=np.int8) != 0, [0]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(m))
    spans = []
    for start, end in zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True):
        if max_turn_tokens is not None:
            end = min(end, start + max_turn_tokens)
        spans.append((start, end))
    return spans


def limited(batch: PackedBatch, max_turn_tokens: int | None = None, stop_ids=()) -> PackedBatch:
    """The batch with every turn's supervision cut where decoding would stop: after the turn's first
    stop token (a chat template may supervise more, e.g. the newline after `<|im_end|>`) and after
    its first `max_turn_tokens` tokens."""
    if max_turn_tokens is None and not len(stop_ids):
        return batch
    mask = torch.zeros_like(batch.loss_mask)
    full = batch.loss_mask.cpu().numpy()
    stops = np.isin(batch.input_ids.cpu().numpy(), np.asarray(list(stop_ids), dtype=np.int64))
    bounds = batch.cu_seqlens_cpu.tolist()
    for bos, eos in zip(bounds[:-1], bounds[1:], strict=True):
        for s, e in turn_spans(full[bos:eos], max_turn_tokens):
            hit = np.flatnonzero(stops[bos + s:bos + e])
            mask[bos + s:bos + (s + hit[0] + 1 if hit.size else e)] = 1
    return PackedBatch(batch.input_ids, mask, batch.position_ids, batch.cu_seqlens, batch.cu_seqlens_cpu,
                       batch.max_seqlen, batch.sample_ids)


def every_anchor(batch: PackedBatch, block_size: int, max_blocks: int = DEFAULT_MAX_BLOCKS) -> list[Anchors]:
    """Blocks at every anchor candidate (a supervised token followed by one) of every sample, in
    chunks of at most `max_blocks` blocks. No sample is skipped, however short its turns."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    m = batch.loss_mask.cpu().numpy() != 0
    bounds = batch.cu_seqlens_cpu.tolist()
    seqs, anchors = [], []
    for s, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        ms = m[bos:eos]
        a = np.flatnonzero(ms[:-1] & ms[1:])
        anchors.append(a)
        seqs.append(np.full(a.size, s))
    seq = torch.from_numpy(np.concatenate(seqs).astype(np.int32)) if seqs else torch.zeros(0, dtype=torch.int32)
    anchor = torch.from_numpy(np.concatenate(anchors).astype(np.int32)) if anchors else seq.clone()
    return [Anchors(seq[i:i + max_blocks], anchor[i:i + max_blocks], block_size, 0)
            for i in range(0, seq.numel(), max_blocks)]


def walk(accepted: np.ndarray, start: int, end: int) -> tuple[int, int]:
    """(tokens, blocks) of greedy decoding over the turn [start, end) of one sample.

    accepted[a]: leading correct draft tokens of the block anchored at a (only the turn's tokens
    count, so a block never accepts past the turn's end). The first token is the prefill's; each
    block adds accepted + 1 tokens until the turn's last token exists.
    """
    a, blocks = start, 0
    while a < end - 1:
        blocks += 1
        a += int(accepted[a]) + 1
    return max(end - start - 1, 0), blocks


@dataclass
class WalkStats:
    """Sums over held-out turns; `metrics()` turns them into the figures (sums, so ranks add up)."""

    block_size: int
    loss_sum: float = 0.0  # slot-weighted CE over every anchor's block
    weight_sum: float = 0.0
    tokens: int = 0  # turn tokens after each turn's first
    blocks: int = 0  # blocks walked (target forwards of decoding)
    turns: int = 0
    anchor_accepted: int = 0  # sum over every anchor of accepted + 1
    anchors: int = 0
    slot_correct: np.ndarray = field(default=None)  # (B-1,) int64
    slot_count: np.ndarray = field(default=None)

    def __post_init__(self) -> None:
        for name in ("slot_correct", "slot_count"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(self.block_size - 1, dtype=np.int64))

    def add(self, other: WalkStats) -> None:
        for name in ("loss_sum", "weight_sum", "tokens", "blocks", "turns", "anchor_accepted", "anchors",
                     "slot_correct", "slot_count"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_tensor(self, device=None) -> torch.Tensor:
        """All sums in one float64 vector (for one all-reduce)."""
        head = [self.loss_sum, self.weight_sum, self.tokens, self.blocks, self.turns, self.anchor_accepted,
                self.anchors]
        return torch.tensor(head + self.slot_correct.tolist() + self.slot_count.tolist(), dtype=torch.float64,
                            device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, block_size: int) -> WalkStats:
        v = t.cpu().tolist()
        n = block_size - 1
        return cls(block_size, v[0], v[1], int(v[2]), int(v[3]), int(v[4]), int(v[5]), int(v[6]),
                   np.asarray(v[7:7 + n], dtype=np.int64), np.asarray(v[7 + n:7 + 2 * n], dtype=np.int64))

    def metrics(self) -> dict:
        return {
            "loss": self.loss_sum / max(self.weight_sum, 1e-12),
            "tau": self.tokens / self.blocks if self.blocks else 1.0,
            "anchor_tau": self.anchor_accepted / self.anchors if self.anchors else 1.0,
            "slot_accuracy": (self.slot_correct / np.maximum(self.slot_count, 1)).tolist(),
            "blocks": self.blocks,
            "tokens": self.tokens,
            "turns": self.turns,
            "anchors": self.anchors,
        }


@torch.no_grad()
def score_and_walk(
    forward: Callable,
    batch: PackedBatch,
    features: torch.Tensor,
    chunks: list[Anchors],
    *,
    block_size: int,
) -> WalkStats:
    """Score the blocks of `chunks` (from `every_anchor(batch)`) and walk every turn of `batch`.

    forward(batch, features, anchors) -> DrafterOutput: the drafter (or its DeepSpeed engine) with the
    anchors given, so the blocks are exactly those of training (same inputs, positions and visibility).
    Cut the turns where decoding stops first (`limited`), for both the anchors and this call.
    """
    stats = WalkStats(block_size)
    accepted = np.zeros(batch.input_ids.numel(), dtype=np.int64)
    bounds = batch.cu_seqlens_cpu.tolist()
    for anchors in chunks:
        out = forward(batch, features, anchors)
        hits = out.hits.cpu()
        acc = torch.cumprod(hits.long(), dim=1).sum(dim=1).numpy()
        starts = np.asarray(bounds)[anchors.block_seq.numpy()]
        accepted[starts + anchors.block_anchor.numpy()] = acc
        stats.loss_sum += float(out.loss_sum)
        stats.weight_sum += float(out.weight_sum)
        stats.anchor_accepted += int(acc.sum()) + acc.size
        stats.anchors += acc.size
        stats.slot_correct += out.slot_correct.cpu().numpy()
        stats.slot_count += out.slot_count.cpu().numpy()
    mask = batch.loss_mask.cpu().numpy()
    for bos, eos in zip(bounds[:-1], bounds[1:], strict=True):
        for s, e in turn_spans(mask[bos:eos]):
            tokens, blocks = walk(accepted, bos + s, bos + e)
            stats.tokens += tokens
            stats.blocks += blocks
            stats.turns += 1
    return stats


def walk_tau(
    forward: Callable,
    batch: PackedBatch,
    features: torch.Tensor,
    *,
    block_size: int,
    max_turn_tokens: int | None = None,
    stop_ids=(),
    max_blocks: int = DEFAULT_MAX_BLOCKS,
) -> WalkStats:
    """Walk tau (and anchor tau, per-slot accuracy, loss) of every assistant turn of one packed batch,
    each turn ending where decoding would: at its first stop token or after `max_turn_tokens`.

    Example:
        feats = target.features(batch)
        stats = walk_tau(lambda b, f, a: drafter(b, f, anchors=a), batch, feats, block_size=drafter.block_size)
        stats.metrics()["tau"]
    """
    batch = limited(batch, max_turn_tokens, stop_ids)
    return score_and_walk(forward, batch, features, every_anchor(batch, block_size, max_blocks), block_size=block_size)


def walk_samples(
    forward: Callable,
    features: Callable,
    samples,
    *,
    block_size: int,
    max_turn_tokens: int | None = None,
    stop_ids=(),
    token_budget: int = 8192,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
) -> WalkStats:
    """Walk tau over tokenized samples `(ids, loss_mask)`, packed in order into batches of at most
    `token_budget` tokens (a longer sample goes alone). features(batch) -> the target's taps."""
    from dflash.data.collate import collate_packed

    stats = WalkStats(block_size)
    groups, group, size = [], [], 0
    for i, (ids, _) in enumerate(samples):
        if group and size + len(ids) > token_budget:
            groups.append(group)
            group, size = [], 0
        group.append(i)
        size += len(ids)
    groups += [group] if group else []
    for g in groups:
        batch = collate_packed(samples, g)
        stats.add(walk_tau(forward, batch, features(batch), block_size=block_size, max_turn_tokens=max_turn_tokens,
                           stop_ids=stop_ids, max_blocks=max_blocks))
    return stats
