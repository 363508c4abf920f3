"""Speculative sampling of DFlash blocks at a temperature, verified as the serving engines verify them.

At temperature T the target samples from p = softmax(logits / T), cut to its top-p nucleus and
renormalised. A DFlash block proposes its B-1 slots in parallel; with `drafts="sampled"` every slot k
draws its token d_k from the drafter's own q_k = softmax(drafter logits / T) (no top-p: vLLM's
probabilistic drafts apply the temperature only), independently of the other slots (q_k depends only
on the context before the block, never on d_<k). The target's verify forward gives p_k for every slot,
conditioned on the drafted tokens before it. Going left to right, d_k is accepted with probability
min(1, p_k(d_k) / q_k(d_k)); at the first rejection the token is drawn from the residual
max(0, p_k - q_k) renormalised and the block ends; when every slot is accepted a bonus token is drawn
from p at the position after the block. The output is distributed as the target's own sampling
(Leviathan et al. 2023, Chen et al. 2023). With `drafts="argmax"` the drafter proposes its argmax
(q one-hot): accepted with probability p_k(d_k), the residual is p_k without d_k.

Which engine does which (`docs/ARCHITECTURE.md` cites the lines): vLLM's probabilistic draft sampling
(`draft_sample_method="probabilistic"`) samples DFlash slots from q at the request temperature and
verifies by the ratio test with the residual max(p - q, 0); vLLM's default greedy drafts and SGLang's
DFlash verification propose the argmax and verify "target only" (q one-hot). T = 0 is greedy decoding:
the leading drafts equal to the target's argmax are accepted (lossless by token equality).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DRAFTS = ("sampled", "argmax")


@dataclass(frozen=True)
class Sampling:
    """How a request is sampled: temperature (0: greedy), top-p nucleus, and how drafts are proposed."""

    temperature: float = 0.0
    top_p: float = 1.0
    drafts: str = "sampled"

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.drafts not in DRAFTS:
            raise ValueError(f"drafts must be one of {', '.join(DRAFTS)}, got {self.drafts!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest set of most likely tokens whose mass reaches top_p, renormalised (rows of `probs`)."""
    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above each one
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)  # the top token always stays (before = 0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """p: the target's sampling distribution (float32) at the temperature, cut to the top-p nucleus."""
    return top_p_filter(torch.softmax(logits.float() / sampling.temperature, dim=-1), sampling.top_p)


def draft_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """q: the drafter's proposal (float32): softmax at the temperature, or one-hot at its argmax."""
    if sampling.drafts == "argmax":
        top = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, top, 1.0)
    return torch.softmax(logits.float() / sampling.temperature, dim=-1)


def verify_block(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[int, int]:
    """The ratio test over one block: (accepted drafts, the token after them).

    drafts: (K,) drafted tokens, drawn from q; q: (K, V) their proposal distributions; p: (K+1, V) the
    target's distributions at the K drafted positions and the one after them (the bonus). Draft k is
    accepted when u_k q_k(d_k) < p_k(d_k), u_k uniform in [0, 1), i.e. with probability
    min(1, p_k(d_k) / q_k(d_k)); the first rejected slot's token comes from max(0, p_k - q_k)
    renormalised, or, all accepted, the bonus from p_K.
    """
    k = drafts.shape[0]
    rows = torch.arange(k, device=drafts.device)
    u = torch.rand(k, generator=generator, device=p.device, dtype=torch.float64)
    ok = u * q[rows, drafts].double() < p[rows, drafts].double()
    accepted = int(ok.long().cumprod(dim=0).sum())
    if accepted == k:
        dist = p[k]
    else:
        dist = (p[accepted] - q[accepted]).clamp_min(0.0)
        if not dist.sum() > 0:  # p == q up to rounding: a rejection there has probability ~0
            dist = p[accepted]
    return accepted, int(torch.multinomial(dist, 1, generator=generator))


class Sampler:
    """The token choices of one decoding run: the target's next token, a block's drafts and its verification.

    Greedy (temperature 0): argmax, and the leading drafts equal to the target's argmax are accepted.
    Otherwise every random draw comes from one generator seeded with `seed`, so a run is repeatable.
    """

    def __init__(self, sampling: Sampling | None = None, seed: int = 0, device: torch.device | str = "cpu"):
        self.sampling = sampling or Sampling()
        self.generator = None
        if not self.sampling.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)

    def next_token(self, logits: torch.Tensor) -> int:
        """The target's token from its logits (V,)."""
        if self.sampling.greedy:
            return int(logits.argmax())
        return int(torch.multinomial(target_probs(logits, self.sampling), 1, generator=self.generator))

    def draft(self, logits: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        """A block's drafts from the drafter's slot logits (B-1, V), and their proposal q (None when greedy)."""
        if self.sampling.greedy:
            return logits.argmax(dim=-1).tolist(), None
        q = draft_probs(logits, self.sampling)
        if self.sampling.drafts == "argmax":
            return q.argmax(dim=-1).tolist(), q
        return torch.multinomial(q, 1, generator=self.generator).squeeze(1).tolist(), q

    def verify(self, drafts: list[int], q: torch.Tensor | None, logits: torch.Tensor) -> tuple[int, int]:
        """(accepted drafts, next token) from the target's logits (B, V) over [anchor, drafts]."""
        if self.sampling.greedy:
            posterior = logits.argmax(dim=-1).tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == posterior[accepted]:
                accepted += 1
            return accepted, posterior[accepted]
        d = torch.tensor(drafts, dtype=torch.long, device=logits.device)
        return verify_block(d, q, target_probs(logits, self.sampling), self.generator)
