"""Plain-PyTorch reference for packed varlen attention: one sample at a time.

Each sample is an ordinary (heads, length, head_dim) attention, so memory is per sample
(never tokens x tokens over the whole pack) and autograd comes from torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def varlen_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """q (T, Hq, D), k/v (T, Hkv, D), cu_seqlens int (S+1,) -> (T, Hq, D)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    bounds = cu_seqlens.tolist()  # host sync: the reference loops on the host anyway
    outs = []
    for bos, eos in zip(bounds[:-1], bounds[1:], strict=True):
        if eos == bos:
            continue
        o = F.scaled_dot_product_attention(
            q[bos:eos].transpose(0, 1),  # (Hq, L, D)
            k[bos:eos].transpose(0, 1),
            v[bos:eos].transpose(0, 1),
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        outs.append(o.transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape)  # no tokens at all
    return torch.cat(outs)
