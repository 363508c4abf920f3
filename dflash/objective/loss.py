"""The loss room: weighted cross-entropy through the frozen lm_head in chunks, the terms that
share its pass (`LogitTerm`), and the acceptance metrics.

Full logits of all block tokens (anchors*B x vocab per sample: 8192 x 151936 floats is 5 GB)
never exist: the forward walks the rows in chunks, keeps only the loss sum, the argmax and
the gradient with respect to the hidden states (the lm_head is frozen, so no weight gradient
is needed), and the backward only scales that saved gradient. Peak memory is
chunk x vocab plus rows x hidden, whatever the number of rows.

Everything returns sums, never means: the trainer divides by the weight total of the whole
optimizer step (all micro-batches, all ranks).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from dflash.objective.blocks import Blocks

DEFAULT_CHUNK_ROWS = 1024
# Loss decay per block size from the paper; other block sizes must set gamma explicitly.
GAMMA_BY_BLOCK_SIZE = {16: 7.0, 10: 5.0, 8: 4.0}


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..B-1, as a (B-1,) float32 tensor."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def default_gamma(block_size: int) -> float:
    if block_size not in GAMMA_BY_BLOCK_SIZE:
        raise ValueError(
            f"no default loss decay gamma for block_size={block_size} (known: "
            f"{sorted(GAMMA_BY_BLOCK_SIZE)}); pass gamma explicitly"
        )
    return GAMMA_BY_BLOCK_SIZE[block_size]


class LogitTerm:
    """One term of the objective besides the cross-entropy, evaluated on each chunk of the drafter's
    logits inside the one chunked lm_head pass (so it never needs a rows x vocab buffer).

    A term is built with its options (`weight` first), gets each micro-batch's `Blocks` and
    `context` (named tensors the drafter or the target provide, e.g. target states) in `start`,
    and returns per chunk the sum of its loss over the chunk's rows and that sum's gradient with
    respect to the chunk's logits. The loss adds `weight` x the sum to `loss_sum` and reports the
    unweighted sum in `LossOutput.parts[name]`.

    Rows are the scored slots, block-major: row r is slot k = r % (B-1) + 1 of block r // (B-1),
    labelled `blocks.labels.view(-1)[r]`, weighted `blocks.weights.view(-1)[r]` (0: not scored).

    A term that also needs what lies outside the lm_head pass (the drafter's hidden states, its own
    modules) overrides `finish`: it runs after the pass, with autograd, on what its chunks collected.
    """

    name = "term"
    vocab_buffers = 1  # (chunk x vocab) float32 buffers it holds at once besides the logits (memory plan)
    # A term that reads only a chunk's top-K (values, ids) and gold logits sets K here and takes them in
    # `head_chunk`: the pass may then run the fused head (`dflash.ops.head_topk`). None: it reads the logits.
    head_top_k: int | None = None
    metric_names: tuple[str, ...] = ()  # the named sums its `finish` reports (`LossOutput.metrics`)
    # the training options it reads (`dflash.options.Option`, section "loss"), by name: `build` takes them
    options: dict = {}
    weighs_blocks = False  # its weights need whole blocks: the loss's chunks hold whole blocks (`chunk_rows_for`)

    @classmethod
    def build(cls, weight: float, options, lm_head: torch.Tensor) -> LogitTerm:
        """The term of `--loss` weight `weight`, with its `options` read from `options` (the run's loss
        section, or any object with those attributes) and the lm_head it may share with the target."""
        return cls(weight)

    def __init__(self, weight: float = 1.0):
        if not weight >= 0:
            raise ValueError(f"the weight of the {self.name} term must be >= 0, got {weight}")
        self.weight = float(weight)

    def start(self, blocks: Blocks, context: dict) -> None:
        """Before the chunks of one micro-batch."""

    def chunk(self, logits: torch.Tensor, lo: int, hi: int,
              need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits (hi - lo, V) float32 of rows lo..hi, read-only -> (loss sum, d sum / d logits or None)."""
        raise NotImplementedError

    def head_chunk(self, stats, rows: torch.Tensor) -> None:
        """With `head_top_k` set: `HeadStats` of the chunk's scored rows `rows` (ids into the pass's rows;
        the rows of weight 0 never reach the head, so a term must not read them)."""
        raise NotImplementedError

    def finish(self, hidden: torch.Tensor, blocks: Blocks, temperatures: tuple[float, ...]) -> Finished:
        """After the chunks: hidden (rows, H) the scored drafter states (differentiable) -> `Finished`.
        Modules it calls are called through their forward (so ZeRO-3 gathers their parameters)."""
        return Finished(hidden.new_zeros((), dtype=torch.float32))

    def figures(self, sums: dict, blocks: float) -> dict:
        """The figures of its named sums (`metric_names`, and `argmax_tau_sum` when it chose the drafts),
        summed over micro-batches and ranks, of `blocks` blocks: what a step's or a walk's record adds."""
        return {}

    def words(self, record: dict) -> str:
        """Its figures in the evaluation's line (after the walk's own)."""
        return ""


class Finished(NamedTuple):
    """What a term adds after the lm_head pass (`LogitTerm.finish`)."""

    loss_sum: torch.Tensor  # scalar float32, differentiable: added to the chunks' sums of the term
    metrics: dict[str, torch.Tensor] = {}  # named detached sums for `LossOutput.metrics`
    # When the term's module chooses the drafts (a candidate selector), what the acceptance
    # metrics read instead of the lm_head's argmax and softmax: per row whether its draft is the label
    # given the labels before it (rows,) bool, and log q_t(label) (rows, len(temperatures)).
    correct: torch.Tensor | None = None
    label_logq: torch.Tensor | None = None


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, chunk_rows, temperatures, ce_weight, terms, logit_map):
        need_grad = ctx.needs_input_grad[0]
        n = hidden.shape[0]
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        parts = torch.zeros(1 + len(terms), dtype=torch.float32, device=hidden.device)  # unweighted: ce, terms
        preds = torch.empty(n, dtype=torch.long, device=hidden.device)
        label_logprobs = torch.empty(n, len(temperatures), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        rows = torch.arange(min(chunk_rows, n), device=hidden.device)
        if fused_head(hidden, terms, temperatures):
            return _fused_pass(ctx, hidden, weight, labels, row_weights, chunk_rows, ce_weight, terms, logit_map,
                               loss_sum, parts, preds, label_logprobs, grad_hidden)
        for lo in range(0, n, chunk_rows):
            hi = min(lo + chunk_rows, n)
            labels_c, w = labels[lo:hi], row_weights[lo:hi].float()
            logits = (hidden[lo:hi] @ weight.t()).float()  # (c, V): the only vocab-wide buffer of the CE
            scale, softcap = logit_map
            slope = scale  # d logits / d raw logits
            if softcap is not None:  # logits = softcap tanh(scale raw / softcap), in place
                logits.mul_(scale / softcap).tanh_()
                slope = (1 - logits.square()).mul_(scale) if need_grad else None
                logits.mul_(softcap)
            elif scale != 1.0:
                logits.mul_(scale)
            preds[lo:hi] = logits.argmax(dim=-1)
            tgt = logits.gather(1, labels_c[:, None]).squeeze(1)
            for i, t in enumerate(temperatures):  # log softmax(logits / t)[label], before the in-place softmax
                label_logprobs[lo:hi, i] = tgt / t - torch.logsumexp(logits / t, dim=-1)
            extra = None  # the other terms' weighted gradient, before the CE overwrites the logits
            for i, term in enumerate(terms):
                part, grad = term.chunk(logits, lo, hi, need_grad)
                parts[1 + i] += part
                loss_sum += term.weight * part
                if need_grad and grad is not None and term.weight:
                    extra = grad.mul_(term.weight) if extra is None else extra.add_(grad, alpha=term.weight)
                del grad
            # Softmax in place on the logits, so a chunk never holds a second (c, V) buffer.
            top = logits.amax(dim=-1, keepdim=True)
            probs = logits.sub_(top).exp_()
            total = probs.sum(dim=-1, keepdim=True)
            lse = (total.log() + top).squeeze(1)
            ce = ((lse - tgt) * w).sum()
            parts[0] += ce
            loss_sum += ce_weight * ce
            if need_grad:
                # d(w * CE)/dlogits = w * (softmax - onehot)
                probs.div_(total)
                probs[rows[: hi - lo], labels_c] -= 1.0
                probs.mul_(w[:, None] * ce_weight)
                if extra is not None:
                    probs.add_(extra)
                if softcap is not None or scale != 1.0:
                    probs.mul_(slope)
                grad_hidden[lo:hi] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
            del logits, probs, extra, slope  # free this chunk before the next one is allocated
        ctx.mark_non_differentiable(preds, label_logprobs, parts)
        if need_grad:
            ctx.save_for_backward(grad_hidden)
        return loss_sum, preds, label_logprobs, parts

    @staticmethod
    def backward(ctx, grad_loss, _grad_preds, _grad_label_logprobs, _grad_parts):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None, None, None, None, None


# "auto": the fused head (`dflash.ops.head_topk`, Triton) where it serves, i.e. on CUDA; "triton" / "torch":
# always, with that backend (tests); "off": never.
HEAD_BACKEND = "auto"


def fused_head(hidden: torch.Tensor, terms, temperatures) -> bool:
    """Whether the pass runs the fused head: a term reads top-K and gold logits (a candidate selector) and
    none reads more; no temperatures."""
    from dflash.ops.common.backend import HAS_TRITON

    if HEAD_BACKEND == "off" or temperatures or not terms or any(getattr(t, "head_top_k", None) is None for t in terms):
        return False
    return HEAD_BACKEND != "auto" or (HAS_TRITON and hidden.is_cuda and hidden.dtype != torch.float64)


def _fused_pass(ctx, hidden, weight, labels, row_weights, chunk_rows, ce_weight, terms, logit_map, loss_sum, parts,
                preds, label_logprobs, grad_hidden):
    """`_ChunkedLinearCE.forward` through the fused head: a chunk's logits stay in the compute dtype, one
    kernel gives their log-sum-exp, gold logit, argmax and top-K, and the backward overwrites them with
    their gradient. Only the rows of positive weight reach the head (one host sync: their count); the
    others get argmax 0 and no gradient."""
    from dflash.ops.head_topk import head_topk, head_topk_backward_

    backend = HEAD_BACKEND
    scale, softcap = logit_map
    top_k = max((t.head_top_k for t in terms), default=0)
    kept = (row_weights > 0).nonzero().squeeze(1)  # host sync: how many rows are scored
    preds.zero_()
    if grad_hidden is not None:
        grad_hidden.zero_()
    for lo in range(0, kept.numel(), chunk_rows):
        rows = kept[lo:lo + chunk_rows]
        labels_c, w = labels[rows], row_weights[rows].float()
        logits = hidden[rows].to(weight.dtype) @ weight.t()  # (c, V) compute dtype: the chunk's only vocab buffer
        stats = head_topk(logits, labels_c, top_k, logit_scale=scale, softcap=softcap, backend=backend)
        preds[rows] = stats.argmax
        ce = ((stats.lse - stats.gold) * w).sum()
        parts[0] += ce
        loss_sum += ce_weight * ce
        for term in terms:
            term.head_chunk(stats, rows)
        if grad_hidden is not None:
            head_topk_backward_(logits, labels_c, stats.lse, w * ce_weight, logit_scale=scale, softcap=softcap,
                                backend=backend)
            grad_hidden[rows] = (logits @ weight).to(hidden.dtype)
        del logits, stats
    ctx.mark_non_differentiable(preds, label_logprobs, parts)
    if grad_hidden is not None:
        ctx.save_for_backward(grad_hidden)
    return loss_sum, preds, label_logprobs, parts


def chunked_loss(hidden, lm_head_weight, labels, row_weights, chunk_rows=None, temperatures=(), *, ce_weight=1.0,
                 terms=(), logit_scale=1.0, softcap=None):
    """The objective's one chunked lm_head pass: ce_weight x weighted cross-entropy plus each term's
    weight x its sum (see `chunked_weighted_ce` for the arguments). The logits everything reads are
    softcap tanh(logit_scale x raw / softcap) (softcap None: logit_scale x raw), as a drafter kind's logit
    map makes them (`DrafterKind.logit_map`).

    Returns (loss_sum, preds, label_logprobs, parts): parts (1 + len(terms),) float32, the unweighted
    sums of the cross-entropy and of each term.
    """
    chunk_rows = DEFAULT_CHUNK_ROWS if chunk_rows is None else chunk_rows
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if lm_head_weight.requires_grad:
        raise ValueError("the lm_head is frozen in DFlash training; pass a weight with requires_grad=False")
    if any(not t > 0 for t in temperatures):
        raise ValueError(f"temperatures must be > 0, got {tuple(temperatures)}")
    if not ce_weight >= 0:
        raise ValueError(f"the cross-entropy weight must be >= 0, got {ce_weight}")
    if not logit_scale > 0 or (softcap is not None and not softcap > 0):
        raise ValueError(f"logit_scale and softcap must be > 0, got {logit_scale} and {softcap}")
    return _ChunkedLinearCE.apply(hidden, lm_head_weight, labels, row_weights, chunk_rows, tuple(temperatures),
                                  float(ce_weight), tuple(terms),
                                  (float(logit_scale), None if softcap is None else float(softcap)))


def chunked_weighted_ce(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    row_weights: torch.Tensor,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    temperatures: tuple[float, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum over rows of row_weights * CE(hidden @ lm_head_weight.T, labels), in row chunks.

    Args:
        hidden: (N, H), differentiable.
        lm_head_weight: (V, H), frozen (no gradient is produced for it).
        labels: (N,) int64 in [0, V) (rows of weight 0 may hold any valid id).
        row_weights: (N,) float, 0 for rows that do not count.
        chunk_rows: rows per chunk; the peak extra memory is about chunk_rows x V floats.
        temperatures: for each t > 0, the label's log-probability under softmax(logits / t) is
            returned too (the eval walk at temperature), from the same chunks of logits.

    Returns:
        loss_sum: scalar float32 (differentiable w.r.t. hidden).
        preds: (N,) int64 argmax of the logits (no gradient), for accuracy and tau.
        label_logprobs: (N, len(temperatures)) float32 (no gradient), log softmax(logits / t)[label].
    """
    loss_sum, preds, label_logprobs, _ = chunked_loss(hidden, lm_head_weight, labels, row_weights, chunk_rows,
                                                      temperatures)
    return loss_sum, preds, label_logprobs


def acceptance_stats(correct: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Offline acceptance length and per-slot accuracy of a set of blocks.

    Args:
        correct: (NB, B-1) bool, drafter argmax == label at slots k = 1..B-1.
        valid: (NB, B-1) bool, the label exists (inside the sample) and is supervised.

    tau of a block = number of leading slots that are valid and correct, plus 1 (the bonus
    token): an invalid slot stops acceptance like a wrong one.

    Returns:
        tau_sum: scalar float32, sum of tau over the blocks.
        slot_correct: (B-1,) int64, correct and valid blocks per slot.
        slot_count: (B-1,) int64, valid blocks per slot.
    """
    hit = correct & valid
    accepted = torch.cumprod(hit.long(), dim=1).sum(dim=1)
    tau_sum = (accepted + 1).sum().float()
    return tau_sum, hit.long().sum(0), valid.long().sum(0)



@dataclass
class LossOutput:
    """Sums over one micro-batch; the trainer divides by totals over the whole optimizer step.

    loss = total loss_sum / total weight_sum; tau = total tau_sum / total num_blocks;
    accuracy of slot k = slot_correct[k-1] / slot_count[k-1].
    """

    loss_sum: torch.Tensor  # scalar float32, differentiable: sum of w_k * CE over scored slots
    weight_sum: torch.Tensor  # scalar float32: sum of w_k over scored slots
    tau_sum: torch.Tensor  # scalar float32: sum over blocks of the offline acceptance length
    slot_correct: torch.Tensor  # (B-1,) int64: argmax == label, per slot k = 1..B-1
    slot_count: torch.Tensor  # (B-1,) int64: scored labels per slot
    hits: torch.Tensor  # (NB, B-1) bool: slot k of block j is valid and correct (the walk, dflash.decoding.acceptance)
    num_blocks: int
    num_skipped: int  # samples skipped for too few supervised tokens
    # unweighted sums of each part of the objective ("ce" and every term's name), detached scalars
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    # (NB, B-1, len(temperatures)) float32, when the loss was given temperatures: log q_t(label) of slot k of
    # block j at each temperature t (the eval walk at temperature), -inf where the label is not valid
    label_logq: torch.Tensor | None = None
    # named detached sums the terms report besides their parts (`LogitTerm.finish`), e.g. "selector_correct",
    # and "argmax_tau_sum" (tau_sum of `argmax_hits`) when a term chose the drafts
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    # when a term chooses the drafts (`Finished.correct`, so `hits` are its path's): the hits of the lm_head's
    # own argmax, (NB, B-1) bool, what the same backbone would accept drafting its argmax
    argmax_hits: torch.Tensor | None = None
    # how the named sums of `metrics` become figures once summed (`BlockLoss.figures`)
    figures: Callable[[dict, float], dict] | None = None


def chunk_vocab_buffers(term_buffers: list[int], softcap: bool) -> int:
    """The most (chunk x vocab) float32 buffers `_ChunkedLinearCE` holds at once, the terms' chunks
    run one after the other: the logits, a softcap's slope, and while a term runs its own buffers
    (its gradient among them) beside the weighted sum of the gradients of the terms before it."""
    peak, summed = 0, False
    for buffers in term_buffers:
        peak = max(peak, buffers + summed)
        summed = summed or buffers > 0
    return 1 + softcap + peak


class BlockLoss:
    """The DFlash objective: slot-weighted cross-entropy of every block's slots 1..B-1 through the
    frozen lm_head (chunked: no rows x vocab buffer), plus any `LogitTerm`s evaluated on the same
    chunks, with the acceptance metrics of the same pass.

    loss_sum = ce_weight x sum of w_k CE + sum over terms of weight x its sum. A new term is a
    `LogitTerm` subclass (its options are its constructor's arguments); nothing else changes.

    Example:
        out = BlockLoss()(drafter(batch, features, blocks), blocks, drafter.lm_head)
        engine.backward(out.loss_sum / step_weight_total)
    """

    def __init__(self, chunk_rows: int = DEFAULT_CHUNK_ROWS, *, ce_weight: float = 1.0, terms=(),
                 logit_scale: float = 1.0, softcap: float | None = None):
        self.chunk_rows, self.ce_weight, self.terms = chunk_rows, float(ce_weight), tuple(terms)
        self.logit_scale, self.softcap = logit_scale, softcap  # the drafter's logits (`chunked_loss`)
        names = ["ce"] + [t.name for t in self.terms]
        if len(set(names)) != len(names):
            raise ValueError(f"loss parts must have distinct names, got {names}")
        if not self.ce_weight and not any(t.weight for t in self.terms):
            raise ValueError("the objective is empty: the cross-entropy weight is 0 and no term weighs anything")

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The named sums of `LossOutput.metrics` its terms report (the same on every rank)."""
        return tuple(name for t in self.terms for name in t.metric_names)

    def figures(self, sums: dict, blocks: float) -> dict:
        """The terms' figures of the named sums over `blocks` blocks (`LogitTerm.figures`)."""
        return {k: v for t in self.terms for k, v in t.figures(sums, blocks).items()}

    def words(self, record: dict) -> str:
        return "".join(t.words(record) for t in self.terms)

    @property
    def vocab_buffers(self) -> int:
        """(chunk x vocab) float32 buffers of one chunk at once (`chunk_vocab_buffers`)."""
        return chunk_vocab_buffers([t.vocab_buffers for t in self.terms], self.softcap is not None)

    def __call__(self, hidden: torch.Tensor, blocks: Blocks, lm_head: torch.Tensor,
                 temperatures: tuple[float, ...] = (), context: dict | None = None) -> LossOutput:
        """hidden (NB*B, H) final-normed drafter states of `blocks`; temperatures: also each label's
        log-probability under the drafter's softmax at these temperatures (> 0), `label_logq`;
        context: named tensors the terms read (see each term)."""
        B, H, n = blocks.block_size, hidden.shape[-1], blocks.num_blocks
        for term in self.terms:
            term.start(blocks, context or {})
        scored = hidden.view(-1, B, H)[:, 1:].reshape(-1, H)  # slot 0 (the anchor) is never scored
        loss_sum, preds, logq, parts = chunked_loss(
            scored.to(lm_head.dtype), lm_head, blocks.labels.reshape(-1), blocks.weights.reshape(-1), self.chunk_rows,
            temperatures, ce_weight=self.ce_weight, terms=self.terms, logit_scale=self.logit_scale,
            softcap=self.softcap,
        )
        metrics, parts = {}, parts.clone()
        correct = argmax_correct = preds.view_as(blocks.labels) == blocks.labels
        for i, term in enumerate(self.terms):  # the parts outside the lm_head pass
            done = term.finish(scored, blocks, tuple(temperatures))
            loss_sum = loss_sum + term.weight * done.loss_sum
            parts[1 + i] += done.loss_sum.detach()
            metrics.update(done.metrics)
            if done.correct is not None:
                correct = done.correct.view_as(blocks.labels)
            if done.label_logq is not None:
                logq = done.label_logq
        valid = blocks.valid
        # [:n] leaves out the zero-weight stand-in block of an empty micro-batch.
        tau_sum, slot_correct, slot_count = acceptance_stats(correct[:n], valid[:n])
        argmax_hits = None
        if correct is not argmax_correct:  # a term chose the drafts: the lm_head argmax's acceptance beside it
            argmax_hits = argmax_correct[:n] & valid[:n]
            metrics["argmax_tau_sum"] = acceptance_stats(argmax_correct[:n], valid[:n])[0]
        return LossOutput(
            loss_sum=loss_sum,
            weight_sum=blocks.weight_sum,
            tau_sum=tau_sum,
            slot_correct=slot_correct,
            slot_count=slot_count,
            hits=correct[:n] & valid[:n],
            num_blocks=n,
            num_skipped=blocks.num_skipped,
            label_logq=logq.view(-1, B - 1, len(temperatures))[:n].masked_fill(
                ~valid[:n, :, None], float("-inf")) if temperatures else None,
            parts=dict(zip(["ce"] + [t.name for t in self.terms], parts.unbind(), strict=True)),
            metrics=metrics,
            argmax_hits=argmax_hits,
            figures=self.figures,
        )
