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

At a temperature T > 0 (`tau@T`) the walk gives the expected acceptance length of speculative
sampling with drafts drawn from the drafter's q = softmax(logits / T) (`dflash.models.sampling`).
Take the turn as the output of decoding. At a block anchored at a, slot k emits the data token
y = y_{a+k}: drafted and accepted with probability min(p_k(y), q_k(y)), or drawn from the residual
with probability max(0, p_k(y) - q_k(y)), which sum to p_k(y); so GIVEN the emitted token, the slot
was an acceptance with probability r_k(a) = min(1, q_k(y) / p_k(y)), where p_k(y) = p(y | y_<a+k)
is the target's probability of the data token given the data before it (the accepted prefix is
the data) and q_k is the drafter's slot-k distribution of the block at a (DFlash drafts the slots
in parallel: q_k depends only on the context up to a, never on the other drafts, exactly as in
decoding and in the scored blocks). Whether a block's slot is accepted does not change the law of
the tokens after it (the lossless property), so given the whole turn the acceptances are
independent with probabilities r: the number of blocks is a Markov chain along the turn whose
expectation `expected_blocks` computes exactly (a block at a accepts M >= m slots with probability
r_1(a) ... r_m(a), and the next block starts at a + M + 1). `tau@T = tokens / expected blocks` has
no sampling noise of its own, and it is exact in expectation when the turns are the target's own
samples at T (e.g. `launch/regenerate.py --temperature T`), as decoding's outputs are; on turns
of another origin (greedy regeneration, human data) it is the acceptance decoding would have
had if it had produced those turns. At T -> 0 the ratios become the greedy hits, and `tau@0` is
`tau`. The estimator uses plain temperature (no top-p). With argmax drafts (q one-hot), r_k is
1 exactly when the drafter's argmax is the data token: the greedy `tau` of turns sampled at T is
the expected acceptance of argmax-draft verification at T (SGLang's DFlash, vLLM's greedy drafts).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash.data.batch import PackedBatch
from dflash.data.supervision import candidate_positions
from dflash.models.anchors import Anchors
from dflash.models.loss import DEFAULT_CHUNK_ROWS

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


def tau_key(temperature: float) -> str:
    """The metric name of the walk at a temperature: tau@0 (greedy, = tau), tau@0.7, tau@1."""
    return f"tau@{temperature:g}"


def stderr_key(temperature: float) -> str:
    """The metric name of tau@T's standard error over turns: tau@1_stderr."""
    return tau_key(temperature) + "_stderr"


def ratio_stderr(n: int, tokens: float, blocks: float, tokens_sq: float, blocks_sq: float,
                 cross: float) -> float | None:
    """The standard error of tau = sum t_i / sum b_i over n turns (t_i tokens, b_i blocks of turn i),
    from the sums of t, b, t^2, b^2 and t b: the delta method, sqrt(sum (t_i - tau b_i)^2 / (n (n-1)))
    / mean b, as `SpeculateReport.acceptance_length_stderr` computes it for decoding. None when n < 2."""
    if n < 2 or blocks <= 0:
        return None
    tau = tokens / blocks
    residual = max(tokens_sq - 2 * tau * cross + tau * tau * blocks_sq, 0.0)
    return float(np.sqrt(residual / (n * (n - 1))) / (blocks / n))


def token_logprobs(output: torch.Tensor, lm_head: torch.Tensor, batch: PackedBatch, temperatures,
                   chunk_rows: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """log p_T(x_t | x_<t) of every token of a packed batch at each temperature (T, len(temperatures)),
    from the target's output states (`TargetModel.features(batch, with_output=True)`) and its lm_head;
    -inf for the first token of each sample (nothing predicts it)."""
    ids = batch.input_ids
    n = ids.numel()
    out = torch.full((n, len(temperatures)), float("-inf"), dtype=torch.float32, device=output.device)
    for lo in range(0, n - 1, chunk_rows):  # the states at t predict the token at t + 1
        hi = min(lo + chunk_rows, n - 1)
        logits = (output[lo:hi] @ lm_head.t()).float()
        tgt = logits.gather(1, ids[lo + 1:hi + 1, None]).squeeze(1)
        for i, t in enumerate(temperatures):
            out[lo + 1:hi + 1, i] = tgt / t - torch.logsumexp(logits / t, dim=-1)
        del logits
    out[batch.cu_seqlens[:-1].long()] = float("-inf")
    return out


def target_inputs(target, batch: PackedBatch, temperatures=()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's taps of a packed batch and, for the temperatures > 0, the log-probability of
    every token (`token_logprobs`, None without such temperatures), from one target forward."""
    sampled = tuple(t for t in temperatures if t > 0)
    if not sampled:
        return target.features(batch), None
    features, output = target.features(batch, with_output=True)
    return features, token_logprobs(output, target.shared_weights().lm_head, batch, sampled)


def slot_ratios(label_logq: torch.Tensor, anchors: np.ndarray, target_logprobs: torch.Tensor) -> np.ndarray:
    """r_k(a) = min(1, q_k(y_{a+k}) / p(y_{a+k} | y_<a+k)) of the blocks anchored at flat positions
    `anchors`, (temperatures, blocks, B-1): label_logq (blocks, B-1, temperatures) from the drafter,
    target_logprobs (tokens, temperatures) from `token_logprobs`. A slot without a label has q = 0
    (log -inf), so r = 0."""
    n = target_logprobs.shape[0]
    labels = torch.from_numpy(anchors[:, None] + np.arange(1, label_logq.shape[1] + 1)).clamp_max(n - 1)
    r = (label_logq - target_logprobs[labels.to(target_logprobs.device)]).clamp_max(0).exp()
    return r.nan_to_num(0.0).permute(2, 0, 1).double().cpu().numpy()


def expected_turn_blocks(ratios: np.ndarray, spans) -> np.ndarray:
    """Expected blocks of speculative sampling over each turn [start, end) of `spans` (flat positions),
    given the turns' tokens: ratios[a, k-1] = r_k(a), the probability that slot k of the block anchored
    at a is accepted given the token it emits (0 where the slot is past the turn or unscored).

    E(a) = 0 once a >= end - 1 (the turn's last token exists), else 1 + sum_m P(M = m) E(a + m + 1),
    with P(M >= m) = r_1(a) ... r_m(a). Positions are solved in order of their distance to the turn's
    end, all turns at once. With 0/1 ratios (the greedy hits) this is `walk`.
    """
    out = np.zeros(len(spans))
    long = [i for i, (s, e) in enumerate(spans) if e - s > 1]
    if not long:
        return out
    n, width = ratios.shape
    pos = np.concatenate([np.arange(spans[i][0], spans[i][1] - 1) for i in long])
    dist = np.concatenate([np.arange(spans[i][1] - 1 - spans[i][0], 0, -1) for i in long])  # e - 1 - a >= 1
    order = np.argsort(dist, kind="stable")
    pos, dist = pos[order], dist[order]
    surv = np.cumprod(ratios[pos], axis=1)  # P(M >= m), m = 1..B-1
    p_ge = np.concatenate([np.ones((pos.size, 1)), surv, np.zeros((pos.size, 1))], axis=1)
    p_eq = p_ge[:, :-1] - p_ge[:, 1:]  # P(M = m), m = 0..B-1
    jumps = np.arange(1, width + 2)  # a block at a moves the anchor to a + m + 1
    e_of = np.zeros(n + width + 2)
    edges = np.flatnonzero(np.diff(dist)) + 1
    for lo, hi in zip(np.concatenate([[0], edges]), np.concatenate([edges, [pos.size]]), strict=True):
        a, d = pos[lo:hi], dist[lo]
        following = np.where(jumps < d, e_of[a[:, None] + jumps], 0.0)
        e_of[a] = 1.0 + (p_eq[lo:hi] * following).sum(axis=1)
    out[long] = e_of[[spans[i][0] for i in long]]
    return out


def expected_blocks(ratios: np.ndarray, spans) -> float:
    """Expected blocks over all the turns of `spans` (`expected_turn_blocks`, summed)."""
    return float(expected_turn_blocks(ratios, spans).sum())


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
    """Sums over held-out turns; `metrics()` turns them into the figures (sums, so ranks add up).
    `temperatures`: those of the walk (`tau@T`); 0 is the greedy walk, each T > 0 has its expected
    blocks in `expected_blocks` (in order)."""

    block_size: int
    temperatures: tuple[float, ...] = ()
    loss_sum: float = 0.0  # slot-weighted CE over every anchor's block
    weight_sum: float = 0.0
    tokens: int = 0  # turn tokens after each turn's first
    blocks: int = 0  # blocks walked (target forwards of decoding)
    turns: int = 0
    anchor_accepted: int = 0  # sum over every anchor of accepted + 1
    anchors: int = 0
    slot_correct: np.ndarray = field(default=None)  # (B-1,) int64
    slot_count: np.ndarray = field(default=None)
    expected_blocks: np.ndarray = field(default=None)  # (temperatures > 0,) float64: expected blocks walked
    # per-turn second moments, for the standard error of tau@T over turns (t_i tokens, e_i expected blocks)
    tokens_sq: float = 0.0  # sum t_i^2
    blocks_sq: np.ndarray = field(default=None)  # (temperatures > 0,): sum e_i^2
    cross: np.ndarray = field(default=None)  # (temperatures > 0,): sum t_i e_i
    # a drafter whose selector chooses the drafts (DFlash2; `LossOutput.argmax_hits`): the greedy walk of
    # the backbone's own argmax beside its path, and the selector's counts over the scored rows
    argmax_blocks: int = 0
    argmax_anchor_accepted: int = 0
    selector_rows: float = 0.0
    selector_recall: float = 0.0
    selector_correct: float = 0.0

    def __post_init__(self) -> None:
        for name in ("slot_correct", "slot_count"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(self.block_size - 1, dtype=np.int64))
        for name in ("expected_blocks", "blocks_sq", "cross"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(len(self.sampled), dtype=np.float64))

    @property
    def sampled(self) -> tuple[float, ...]:
        """The temperatures > 0, in order (those with expected blocks)."""
        return tuple(t for t in self.temperatures if t > 0)

    def add(self, other: WalkStats) -> None:
        for name in self._SCALARS + ("slot_correct", "slot_count", "expected_blocks", "blocks_sq", "cross"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    _SCALARS = ("loss_sum", "weight_sum", "tokens", "blocks", "turns", "anchor_accepted", "anchors", "tokens_sq",
                "argmax_blocks", "argmax_anchor_accepted", "selector_rows", "selector_recall", "selector_correct")
    _COUNTS = ("tokens", "blocks", "turns", "anchor_accepted", "anchors", "argmax_blocks", "argmax_anchor_accepted")

    def to_tensor(self, device=None) -> torch.Tensor:
        """All sums in one float64 vector (for one all-reduce)."""
        head = [getattr(self, name) for name in self._SCALARS]
        return torch.tensor(head + self.slot_correct.tolist() + self.slot_count.tolist() + self.expected_blocks.tolist()
                            + self.blocks_sq.tolist() + self.cross.tolist(), dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, block_size: int, temperatures=()) -> WalkStats:
        v = t.cpu().tolist()
        n, head = block_size - 1, len(cls._SCALARS)
        sampled = sum(1 for x in temperatures if x > 0)
        tail = [np.asarray(v[head + 2 * n + i * sampled:head + 2 * n + (i + 1) * sampled], dtype=np.float64)
                for i in range(3)]
        scalars = {name: int(x) if name in cls._COUNTS else x for name, x in zip(cls._SCALARS, v[:head], strict=True)}
        return cls(block_size, tuple(temperatures), **scalars,
                   slot_correct=np.asarray(v[head:head + n], dtype=np.int64),
                   slot_count=np.asarray(v[head + n:head + 2 * n], dtype=np.int64), expected_blocks=tail[0],
                   blocks_sq=tail[1], cross=tail[2])

    def metrics(self) -> dict:
        """The figures; at each T > 0, `tau@T` and its standard error over turns `tau@T_stderr` (None
        with fewer than 2 turns), which counts the spread between turns, as decoding's does."""
        tau = self.tokens / self.blocks if self.blocks else 1.0
        at = {}
        for t in self.temperatures:
            if t == 0:
                at[tau_key(t)] = tau
                continue
            i = self.sampled.index(t)
            blocks = float(self.expected_blocks[i])
            at[tau_key(t)] = self.tokens / blocks if blocks else 1.0
            at[stderr_key(t)] = ratio_stderr(self.turns, self.tokens, blocks, self.tokens_sq, float(self.blocks_sq[i]),
                                             float(self.cross[i]))
        selector = {}
        if self.selector_rows:  # a DFlash2 drafter: `tau` is its selector path's, `argmax_tau` its argmax's
            from dflash.models.dflash2 import selector_figures

            selector = selector_figures({"selector_rows": self.selector_rows, "selector_recall": self.selector_recall,
                                         "selector_correct": self.selector_correct,
                                         "argmax_tau_sum": self.argmax_anchor_accepted}, self.anchors)
            selector["argmax_tau"] = self.tokens / self.argmax_blocks if self.argmax_blocks else 1.0
        return {
            "loss": self.loss_sum / max(self.weight_sum, 1e-12),
            "tau": tau,
            **at,
            "anchor_tau": self.anchor_accepted / self.anchors if self.anchors else 1.0,
            "slot_accuracy": (self.slot_correct / np.maximum(self.slot_count, 1)).tolist(),
            "blocks": self.blocks,
            "tokens": self.tokens,
            "turns": self.turns,
            "anchors": self.anchors,
            **selector,
        }


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
    given (`dflash.models.blocks.block_scorer`), exactly those of training (inputs, positions, visibility).
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
    argmax_accepted = None  # the backbone's own argmax, where a selector chooses the drafts
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
        for name in ("selector_rows", "selector_recall", "selector_correct"):
            setattr(stats, name, getattr(stats, name) + float(out.metrics.get(name, 0.0)))
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
