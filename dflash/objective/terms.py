"""The objective's terms besides the cross-entropy (`LogitTerm`s of `dflash.objective.loss`), and the
`--loss` recipe that mixes them.

- `DPaceTerm` (D-PACE): the cross-entropy of every slot weighted by how much its confidence moves
  the block's expected acceptance, a detached weight (SpecForge `specforge/core/dflash.py`
  `_dpace_weight`, vLLM speculators `speculators/losses` `dpace_loss_decay`).
- `KLTerm`: KL(target || drafter) at temperature T, the target's own next-token distribution.
- `LKTerm` (LK, Samarin et al., arXiv 2602.23881): -log of the expected acceptance rate
  alpha = sum_v min(p_v, q_v) of speculative sampling (SpecForge `specforge/core/lk_loss.py`,
  speculators `neg_log_acceptance_loss`), per scored row.

KL and LK read the target's distribution at each label's position: the target's final-normed
hidden states (`TargetModel.features(..., with_output=True)`, once per token) through the shared
lm_head, computed per chunk once for each distinct label position of the chunk. Anchors are
sorted within a sample and blocks are block-major, so a chunk covers consecutive positions: a
token's target logits are computed once, twice only where two chunks meet.
"""
from __future__ import annotations

import math

import torch

from dflash.objective.loss import DEFAULT_CHUNK_ROWS, LogitTerm
from dflash.options import Option

TARGET_STATES = "target_states"  # context key: (tokens, H) final-normed target hidden states, packed order
CU_SEQLENS = "cu_seqlens"  # context key: (S+1,) sample boundaries of the packed layout


def _softmax_parts(logits: torch.Tensor, temperature: float):
    """softmax(logits / t) in a new buffer, and logsumexp(logits / t) per row (one (c, V) buffer)."""
    probs = logits / temperature
    top = probs.amax(dim=-1, keepdim=True)
    probs.sub_(top).exp_()
    total = probs.sum(dim=-1, keepdim=True)
    probs.div_(total)
    return probs, (total.log() + top).squeeze(1)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row dot products of two (c, V) tensors without a (c, V) product buffer."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class DPaceTerm(LogitTerm):
    """D-PACE: sum over scored rows of W_k x CE_k, W detached. With q_j the drafter's probability of
    the label at slot j (1 where the slot is not valid), s_j = (1 - alpha) q_j + alpha, the prefix
    P_t = s_1 ... s_t and W_k = valid_k x sum_{t >= k} valid_t P_t: how much the block's expected
    accepted length (smoothed by alpha) grows with slot k's log-confidence. No gamma decay (it
    replaces it, as in SpecForge and speculators); mix with the decayed CE through the weights.

    A chunk must hold whole blocks: `BlockLoss(chunk_rows=block_chunk_rows(rows, B))`.
    """

    name = "dpace"
    vocab_buffers = 1  # the softmax that becomes the gradient
    options = {"dpace_alpha": Option("loss", 0.5, "D-PACE confidence smoothing: a slot's confidence counts as "
                                     "(1 - a) q + a", (lambda v: 0 <= v <= 1, "must be in [0, 1]"))}
    weighs_blocks = True

    @classmethod
    def build(cls, weight, options, lm_head):
        return cls(weight, alpha=options.dpace_alpha)

    def __init__(self, weight: float = 1.0, alpha: float = 0.5):
        super().__init__(weight)
        if not 0 <= alpha <= 1:
            raise ValueError(f"the D-PACE smoothing alpha must be in [0, 1], got {alpha}")
        self.alpha = float(alpha)

    def start(self, blocks, context: dict) -> None:
        self.per_block = blocks.block_size - 1
        self.labels, self.valid = blocks.labels.reshape(-1), blocks.valid.reshape(-1)

    def chunk(self, logits, lo, hi, need_grad):
        k = self.per_block
        if lo % k or (hi - lo) % k:
            raise ValueError(f"D-PACE weighs whole blocks: chunk rows {lo}..{hi} split a block of {k} scored slots "
                             "(build the loss with chunk_rows=block_chunk_rows(rows, block_size))")
        probs, lse = _softmax_parts(logits, 1.0)
        labels, valid = self.labels[lo:hi], self.valid[lo:hi]
        ce = lse - logits.gather(1, labels[:, None]).squeeze(1)
        with torch.no_grad():
            q = torch.exp(-ce).view(-1, k)
            mask = valid.view(-1, k).float()
            smooth = torch.where(mask > 0, (1 - self.alpha) * q + self.alpha, torch.ones_like(q))
            prefix = torch.cumprod(smooth, dim=1)
            w = (torch.flip(torch.cumsum(torch.flip(prefix * mask, [1]), 1), [1]) * mask).view(-1)
        part = (w * ce).sum()
        if not need_grad:
            return part, None
        probs[torch.arange(hi - lo, device=probs.device), labels] -= 1.0
        return part, probs.mul_(w[:, None])


class _TargetDistributionTerm(LogitTerm):
    """A term against the target's next-token distribution at temperature t: the label at packed
    position P (slot k of a block anchored at a) is the target's prediction from position P - 1,
    softmax(lm_head(target_states[P - 1]) / t)."""

    needs_target_states = True  # the trainer runs the target to its final norm and passes its states
    options = {"distill_temperature": Option("loss", 1.0, "temperature of the target's and the drafter's softmax in "
                                             "kl and lk", (lambda v: v > 0, "must be > 0"))}

    @classmethod
    def build(cls, weight, options, lm_head):
        return cls(weight, options.distill_temperature, lm_head=lm_head)

    def __init__(self, weight: float = 1.0, temperature: float = 1.0, *, lm_head: torch.Tensor | None = None):
        super().__init__(weight)
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"the temperature of the {self.name} term must be a finite number > 0, got {temperature}")
        self.temperature, self.lm_head = float(temperature), lm_head

    def start(self, blocks, context: dict) -> None:
        if TARGET_STATES not in context or CU_SEQLENS not in context:
            raise ValueError(f"the {self.name} term needs the target's final states: pass context "
                             f"{{'{TARGET_STATES}': ..., '{CU_SEQLENS}': ...}} (see target_context)")
        if self.lm_head is None:
            raise ValueError(f"the {self.name} term needs the lm_head it shares with the target (lm_head=)")
        states, cu = context[TARGET_STATES], context[CU_SEQLENS].long()
        a, B = blocks.anchors, blocks.block_size
        start = cu[a.block_seq.long()] + a.block_anchor.long()
        k = torch.arange(B - 1, device=start.device)  # slot k + 1 is predicted from position anchor + k
        self.positions = (start[:, None] + k[None, :]).reshape(-1).clamp(0, states.shape[0] - 1)
        self.states = states
        self.row_weights = blocks.weights.reshape(-1)

    def target_probs(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's probabilities (U, V) float32 of the U distinct positions of rows lo..hi, each
        computed once, and (hi - lo,) the index of each row's position among them."""
        unique, inverse = torch.unique(self.positions[lo:hi], return_inverse=True)
        logits = (self.states[unique].to(self.lm_head.dtype) @ self.lm_head.t()).float()
        if hi >= self.positions.numel():  # the last chunk: the states are not held past the loss
            self.states = None
        probs, _ = _softmax_parts(logits, self.temperature)
        return probs, inverse


class KLTerm(_TargetDistributionTerm):
    """sum over scored rows of w_r x KL(p_r || q_r), p = the target's softmax at temperature t,
    q = the drafter's softmax(logits / t). Gradient w.r.t. the logits: w (q - p) / t."""

    name = "kl"
    vocab_buffers = 2  # the target's probabilities of the rows and the drafter's softmax (the gradient)

    def chunk(self, logits, lo, hi, need_grad):
        t, w = self.temperature, self.row_weights[lo:hi].float()
        unique, inverse = self.target_probs(lo, hi)
        neg_entropy = torch.special.xlogy(unique, unique).sum(dim=-1)[inverse]  # sum_v p log p, per position
        p = unique[inverse]
        del unique
        q, lse = _softmax_parts(logits, t)
        # sum_v p (log p - log q) = sum_v p log p - (p . logits) / t + lse
        kl = neg_entropy - _rowdot(p, logits) / t + lse
        part = (w * kl).sum()
        if not need_grad:
            return part, None
        return part, q.sub_(p).mul_((w / t)[:, None])


class LKTerm(_TargetDistributionTerm):
    """LK: sum over scored rows of w_r x -log alpha_r, alpha_r = sum_v min(p_v, q_v) the chance that
    speculative sampling accepts the drafter's token (p: the target's softmax, q: the drafter's, both
    at temperature t), clamped below at `eps` as speculators does."""

    name = "lk"
    vocab_buffers = 2  # the target's probabilities of the rows and the drafter's softmax (the gradient)

    def __init__(self, weight: float = 1.0, temperature: float = 1.0, *, lm_head=None, eps: float = 1e-5):
        super().__init__(weight, temperature, lm_head=lm_head)
        self.eps = float(eps)

    def chunk(self, logits, lo, hi, need_grad):
        t, w = self.temperature, self.row_weights[lo:hi].float()
        unique, inverse = self.target_probs(lo, hi)
        p = unique[inverse]
        del unique
        q, _ = _softmax_parts(logits, t)
        # min(p, q) = p - relu(p - q); then p becomes the indicator of q < p (where alpha grows with q)
        over = p.sub_(q).clamp_(min=0)
        alpha = 1 - over.sum(dim=-1)
        clamped = alpha < self.eps
        part = (w * -torch.log(alpha.clamp_min(self.eps))).sum()
        if not need_grad:
            return part, None
        below = over.gt_(0)  # 1.0 where q < p
        # d alpha / d logits = q (1[q < p] - sum_v q 1[q < p]) / t; d(-log alpha) = -that / alpha
        s = _rowdot(q, below)
        scale = torch.where(clamped, torch.zeros_like(alpha), -w / (alpha.clamp_min(self.eps) * t))
        return part, q.mul_(below.sub_(s[:, None])).mul_(scale[:, None])


TERMS = {"dpace": DPaceTerm, "kl": KLTerm, "lk": LKTerm}


def parse_recipe(text: str) -> dict[str, float]:
    """`--loss` as {part: weight}: comma-separated name=weight (names ce and TERMS), e.g.
    "ce=1,dpace=0.5"; ce is 0 unless named. Raises ValueError naming what is wrong."""
    weights: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if name not in ("ce", *TERMS):
            raise ValueError(f"unknown part {name!r} (known: ce, {', '.join(TERMS)})")
        if name in weights:
            raise ValueError(f"{name} is given twice")
        try:
            weight = float(value) if sep else 1.0
        except ValueError:
            raise ValueError(f"{name}={value.strip()}: the weight must be a number") from None
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"{name}={value.strip()}: the weight must be a finite number >= 0")
        weights[name] = weight
    if not any(weights.values()):
        raise ValueError(f"{text!r} weighs nothing: give at least one part a weight > 0, e.g. ce=1")
    return weights


def block_chunk_rows(chunk_rows: int, block_size: int) -> int:
    """The most rows <= chunk_rows that hold whole blocks (B - 1 scored rows each), at least one block."""
    per_block = block_size - 1
    return max(per_block, chunk_rows // per_block * per_block)


def term_options() -> dict:
    """Every term's training options by name: (its term, the `Option`)."""
    return {name: (term, option) for term in TERMS.values() for name, option in term.options.items()}


def chunk_rows_for(weights: dict[str, float], block_size: int) -> int:
    """The rows of a loss chunk for a parsed recipe: whole blocks when a term weighs blocks (`weighs_blocks`)."""
    blocks = any(TERMS[name].weighs_blocks for name, weight in weights.items() if name != "ce" and weight)
    return block_chunk_rows(DEFAULT_CHUNK_ROWS, block_size) if blocks else DEFAULT_CHUNK_ROWS


def build_terms(weights: dict[str, float], options=None, *, lm_head: torch.Tensor) -> list[LogitTerm]:
    """The terms of a parsed recipe (weight 0: left out), each with its options read from `options` (the
    loss section; None: every option's default)."""
    if options is None:
        from types import SimpleNamespace

        options = SimpleNamespace(**{name: o.default for name, (_, o) in term_options().items()})
    return [TERMS[name].build(weight, options, lm_head) for name, weight in weights.items()
            if name != "ce" and weight]


def needs_target_states(loss) -> bool:
    """Whether a BlockLoss has a term that reads the target's final states."""
    return any(getattr(t, "needs_target_states", False) for t in loss.terms)


def target_context(states: torch.Tensor, packed_batch) -> dict:
    """The context the target-distribution terms read: the target's final states (tokens, H) of a
    packed micro-batch (`TargetModel.features(batch, with_output=True)[1]`) and its boundaries."""
    return {TARGET_STATES: states, CU_SEQLENS: packed_batch.cu_seqlens}
