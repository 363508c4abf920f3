"""The reference: the frozen head's statistics of one chunk of logits with torch ops on an fp32 copy (the
loss room's own arithmetic), and the cross-entropy's gradient written back into the chunk."""
from __future__ import annotations

import torch


def mapped(raw: torch.Tensor, logit_scale: float, softcap: float | None) -> torch.Tensor:
    """softcap tanh(logit_scale raw / softcap) (softcap None: logit_scale raw), fp32."""
    z = raw.float() * logit_scale
    return z if softcap is None else torch.tanh(z / softcap) * softcap


def head_topk_naive(logits, labels, top_k, logit_scale=1.0, softcap=None):
    """-> (lse, gold, argmax, top_values, top_ids) of the mapped logits; see `head_topk`."""
    z = mapped(logits, logit_scale, softcap)
    values, ids = z.topk(top_k, dim=-1)
    return torch.logsumexp(z, dim=-1), z.gather(1, labels[:, None]).squeeze(1), z.argmax(dim=-1), values, ids


def head_topk_backward_naive_(logits, labels, lse, coef, logit_scale=1.0, softcap=None):
    """logits <- coef[r] (softmax(z)[v] - [v = label]) dz/draw, in place (logits' dtype)."""
    z = mapped(logits, logit_scale, softcap)
    grad = (z - lse[:, None]).exp()
    grad[torch.arange(len(labels), device=labels.device), labels] -= 1.0
    grad *= coef[:, None]
    if softcap is not None:
        grad *= (1 - (z / softcap).square()) * logit_scale
    elif logit_scale != 1.0:
        grad *= logit_scale
    return logits.copy_(grad)
