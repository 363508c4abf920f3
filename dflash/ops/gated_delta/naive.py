"""Plain-PyTorch references for the Gated DeltaNet token mixer on packed rows: the short causal
convolution and the gated delta rule, both restarting at every sample boundary of `cu_seqlens`.

The delta rule is written in its recurrent form (one state update per position), stepping all
samples of the pack together: position p of every sample at least p + 1 long is one batched
update, so the loop runs max_seqlen times, and a sample's state starts at zero by construction.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _sample_starts(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(T,) the packed row where each token's sample starts."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(cu_seqlens[:-1].long(), lengths, output_size=total)


def causal_conv1d_varlen_naive(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               cu_seqlens: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """Depthwise causal convolution per sample: x (T, C), weight (C, W) -> (T, C);
    y[t] = sum_w weight[:, w] * x[t - (W - 1) + w], taps before the sample's start read zero."""
    t, width = x.shape[0], weight.shape[1]
    start = _sample_starts(cu_seqlens, t)
    rows = torch.arange(t, device=x.device)
    acc = torch.promote_types(x.dtype, torch.float32)
    y = torch.zeros(x.shape, dtype=acc, device=x.device)
    for w in range(width):
        src = rows - (width - 1) + w
        ok = src >= start
        y += torch.where(ok[:, None], x[src.clamp_min(0)].to(acc), 0.0) * weight[:, w].to(acc)
    if bias is not None:
        y += bias.to(acc)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    return y.to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (flash-linear-attention's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_varlen_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None,
                                  use_qk_l2norm: bool = False) -> torch.Tensor:
    """The gated delta rule per sample, from a zero state: q/k (T, Hk, Dk), v (T, Hv, Dv), g/beta (T, Hv)
    -> (T, Hv, Dv). Per position, with S (Dk, Dv) per value head:

        S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T (scale q)

    Hv a multiple of Hk: query/key head h serves value heads h*G .. h*G + G-1. Computed in fp32."""
    t, hk, dk = k.shape
    hv, dv = v.shape[1:]
    acc = torch.promote_types(v.dtype, torch.float32)
    q, k = (x.to(acc).repeat_interleave(hv // hk, dim=1) for x in (q, k))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (dk ** -0.5 if scale is None else scale)
    v, g, beta = v.to(acc), g.to(acc), beta.to(acc)
    bounds = cu_seqlens.tolist()
    starts = torch.tensor(bounds[:-1], dtype=torch.long, device=v.device)
    lengths = torch.tensor(bounds[1:], dtype=torch.long, device=v.device) - starts
    order = torch.argsort(lengths, descending=True, stable=True)  # active samples: a prefix
    starts, lengths = starts[order], lengths[order].tolist()
    state = torch.zeros(len(lengths), hv, dk, dv, dtype=acc, device=v.device)
    out = torch.zeros(t, hv, dv, dtype=acc, device=v.device)
    active = len(lengths)
    for p in range(lengths[0] if lengths else 0):
        while lengths[active - 1] <= p:
            active -= 1
        rows = starts[:active] + p
        s = state[:active] * g[rows].exp()[..., None, None]
        kt = k[rows]
        delta = (v[rows] - torch.einsum("ahkv,ahk->ahv", s, kt)) * beta[rows][..., None]
        s = s + kt[..., :, None] * delta[..., None, :]
        out[rows] = torch.einsum("ahkv,ahk->ahv", s, q[rows])
        state[:active] = s
    return out.to(v.dtype)
