"""tau@T: the expected acceptance length of speculative sampling at a temperature, from the same
blocks at every position as the greedy walk (`dflash.decoding.acceptance`).

At a temperature T > 0 (`tau@T`) the walk gives the expected acceptance length of speculative
sampling with drafts drawn from the drafter's q = softmax(logits / T) (`dflash.decoding.sampling`).
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

import numpy as np
import torch

from dflash.data.batch import PackedBatch
from dflash.objective.loss import DEFAULT_CHUNK_ROWS


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
