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

At a temperature T > 0 the same scores give `tau@T`, the expected acceptance length of speculative
sampling (`dflash.decoding.expected_walk`); the sums and figures: `dflash.decoding.walk_stats`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from dflash.data.batch import PackedBatch
from dflash.data.supervision import candidate_positions
from dflash.decoding.expected_walk import expected_turn_blocks, slot_ratios, target_inputs
from dflash.decoding.walk_stats import WalkStats
from dflash.objective.anchors import Anchors

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
    return replace(batch, loss_mask=mask)


def every_anchor(batch: PackedBatch, block_size: int, max_blocks: int = DEFAULT_MAX_BLOCKS) -> list[Anchors]:
    """Blocks at every anchor candidate (a supervised token followed by one) of every sample, in
    chunks of at most `max_blocks` blocks. No sample is skipped, however short its turns."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    m = batch.loss_mask.cpu().numpy() != 0
    bounds = batch.cu_seqlens_cpu.tolist()
    seqs, anchors = [], []
    for s, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        a = candidate_positions(m[bos:eos])
        anchors.append(a)
        seqs.append(np.full(a.size, s))
    seq = torch.from_numpy(np.concatenate(seqs).astype(np.int32)) if seqs else torch.zeros(0, dtype=torch.int32)
    anchor = torch.from_numpy(np.concatenate(anchors).astype(np.int32)) if anchors else seq.clone()
    return [Anchors(seq[i:i + max_blocks], anchor[i:i + max_blocks], block_size, 0)
            for i in range(0, seq.numel(), max_blocks)]


def heldout_batches(lengths, token_budget: int, *, sort: bool = False, seed: int = 0) -> list[np.ndarray]:
    """The held-out planner: samples of `lengths` packed into batches of at most `token_budget` tokens
    (a longer sample goes alone), as index arrays. In the given order, a batch closing when the next
    sample does not fit (the batch planner's packer with one open bin); `sort`: the batch planner's
    sorted packed plan (by length, best fit, batches in the order `seed` deals them)."""
    from dflash.data import packing
    from dflash.data.planner import PlannerConfig, plan_batches

    lengths = np.asarray(lengths, dtype=np.int64)
    if sort:
        return plan_batches(lengths, PlannerConfig(token_budget, "sorted", "packed", seed=seed))[0]
    if lengths.size == 0:
        return []
    items, offsets = packing.pack_best_fit(np.clip(lengths, 1, token_budget), token_budget, window=1)
    return np.split(items, offsets[1:-1])


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


@torch.no_grad()
def score_and_walk(
    forward: Callable,
    batch: PackedBatch,
    features: torch.Tensor,
    chunks: list[Anchors],
    *,
    block_size: int,
    temperatures=(),
    target_logprobs: torch.Tensor | None = None,
) -> WalkStats:
    """Score the blocks of `chunks` (from `every_anchor(batch)`) and walk every turn of `batch`.

    forward(batch, features, anchors) -> LossOutput: the drafter and its loss on the blocks at the anchors
    given (`dflash.objective.blocks.block_scorer`), exactly those of training (inputs, positions, visibility).
    Cut the turns where decoding stops first (`limited`), for both the anchors and this call.
    temperatures: of the walk (`tau@T`, 0 = greedy); for those > 0, forward is called with
    `temperatures=` them (the drafter's `label_logq`) and `target_logprobs` (`token_logprobs`) must
    hold the target's log-probabilities of the batch's tokens at them.
    """
    stats = WalkStats(block_size, tuple(temperatures))
    sampled = stats.sampled
    if sampled and target_logprobs is None:
        raise ValueError(f"the walk at temperatures {sampled} needs the target's token log-probabilities")
    n = batch.input_ids.numel()
    accepted = np.zeros(n, dtype=np.int64)
    argmax_accepted = None  # the backbone's own argmax, where the network chooses the drafts
    ratios = np.zeros((len(sampled), n, block_size - 1))
    bounds = batch.cu_seqlens_cpu.tolist()
    for anchors in chunks:
        out = forward(batch, features, anchors, temperatures=sampled) if sampled else forward(batch, features, anchors)
        pos = np.asarray(bounds)[anchors.block_seq.cpu().numpy()] + anchors.block_anchor.cpu().numpy()
        acc = torch.cumprod(out.hits.cpu().long(), dim=1).sum(dim=1).numpy()
        accepted[pos] = acc
        if sampled:
            ratios[:, pos] = slot_ratios(out.label_logq, pos, target_logprobs)
        stats.loss_sum += float(out.loss_sum)
        stats.weight_sum += float(out.weight_sum)
        stats.anchor_accepted += int(acc.sum()) + acc.size
        stats.anchors += acc.size
        stats.slot_correct += out.slot_correct.cpu().numpy()
        stats.slot_count += out.slot_count.cpu().numpy()
        if out.argmax_hits is not None:
            argmax_accepted = np.zeros(n, dtype=np.int64) if argmax_accepted is None else argmax_accepted
            acc = torch.cumprod(out.argmax_hits.cpu().long(), dim=1).sum(dim=1).numpy()
            argmax_accepted[pos] = acc
            stats.argmax_anchor_accepted += int(acc.sum()) + acc.size
        for name, value in out.metrics.items():
            if name != "argmax_tau_sum":  # walked here from `argmax_hits`
                stats.metric_sums[name] = stats.metric_sums.get(name, 0.0) + float(value)
        stats.figures = stats.figures or out.figures
    mask = batch.loss_mask.cpu().numpy()
    spans = [(bos + s, bos + e) for bos, eos in zip(bounds[:-1], bounds[1:], strict=True)
             for s, e in turn_spans(mask[bos:eos])]
    turn_tokens = np.zeros(len(spans))
    for i, (s, e) in enumerate(spans):
        tokens, blocks = walk(accepted, s, e)
        turn_tokens[i] = tokens
        stats.tokens += tokens
        stats.blocks += blocks
        stats.turns += 1
        if argmax_accepted is not None:
            stats.argmax_blocks += walk(argmax_accepted, s, e)[1]
    stats.tokens_sq += float((turn_tokens ** 2).sum())
    for i, r in enumerate(ratios):
        per_turn = expected_turn_blocks(r, spans)
        stats.expected_blocks[i] += per_turn.sum()
        stats.blocks_sq[i] += (per_turn ** 2).sum()
        stats.cross[i] += (per_turn * turn_tokens).sum()
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
    temperatures=(),
    target_logprobs: torch.Tensor | None = None,
) -> WalkStats:
    """Walk tau (and anchor tau, per-slot accuracy, loss) of every assistant turn of one packed batch,
    each turn ending where decoding would: at its first stop token or after `max_turn_tokens`; with
    `temperatures` also `tau@T` (see `score_and_walk`).

    Example:
        feats, logp = target_inputs(target, batch, (1.0,))
        score = block_scorer(drafter, BlockLoss(), drafter.lm_head, mask_token_id=m, slot_weights=w)
        stats = walk_tau(score, batch, feats,
                         block_size=drafter.block_size, temperatures=(0, 1.0), target_logprobs=logp)
        stats.metrics()["tau"], stats.metrics()["tau@1"]
    """
    batch = limited(batch, max_turn_tokens, stop_ids)
    return score_and_walk(forward, batch, features, every_anchor(batch, block_size, max_blocks), block_size=block_size,
                          temperatures=temperatures, target_logprobs=target_logprobs)


def walk_samples(
    forward: Callable,
    target,
    samples,
    *,
    block_size: int,
    max_turn_tokens: int | None = None,
    stop_ids=(),
    token_budget: int = 8192,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
    temperatures=(),
    device=None,
) -> WalkStats:
    """Walk tau (and `tau@T` at `temperatures`) over tokenized samples `(ids, loss_mask)`, packed in
    order into batches of at most `token_budget` tokens (a longer sample goes alone), on `device`.
    target: the `TargetModel`; forward as in `score_and_walk`."""
    from dflash.data.collate import collate_packed

    stats = WalkStats(block_size, tuple(temperatures))
    groups = heldout_batches(np.fromiter((len(ids) for ids, _ in samples), dtype=np.int64, count=len(samples)),
                             token_budget)
    for g in groups:
        batch = collate_packed(samples, g)
        batch = batch if device is None else batch.to(device)
        features, logprobs = target_inputs(target, batch, temperatures)
        stats.add(walk_tau(forward, batch, features, block_size=block_size, max_turn_tokens=max_turn_tokens,
                           stop_ids=stop_ids, max_blocks=max_blocks, temperatures=temperatures,
                           target_logprobs=logprobs))
    return stats
