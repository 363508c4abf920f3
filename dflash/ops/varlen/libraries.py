"""Packed varlen attention through public kernels: torch's varlen_attn, flash-attn's
flash_attn_varlen_func and FlexAttention with a document mask (the `backend=` alternatives).

Sliding windows go to each kernel's own window argument (FlexAttention: the mask). Attention
sinks are folded in from the log-sum-exp every kernel returns: a sink is one more key with logit
`s` and a zero value, so the output with it is `o * exp(lse) / (exp(lse) + exp(s))` =
`o * sigmoid(lse - s)`. A value head dim other than the query's (MLA) is served natively by
FlexAttention; the two FlashAttention kernels get zero-padded values (exact), sliced after.
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F


@functools.cache
def _parameters(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """out (T, H, Dv) of a softmax without sinks, lse (H, T) natural log -> out with one sink per head."""
    keep = torch.sigmoid(lse.float() - sinks.float()[:, None])  # (H, T)
    return (out.float() * keep.t()[:, :, None]).to(out.dtype)


def _pad_values(q, v):
    """Values zero-padded to the query head dim (the FlashAttention kernels need one head dim)."""
    return v if v.shape[-1] == q.shape[-1] else F.pad(v, (0, q.shape[-1] - v.shape[-1]))


def _torch_varlen(q, k, v, cu_seqlens, max_seqlen, causal, scale, left, sinks):
    from torch.nn.attention import varlen

    params = _parameters(varlen.varlen_attn)
    if "window_size" in params:
        kwargs = {"window_size": (left, 0) if causal else (-1, -1)}
    elif left >= 0:
        raise RuntimeError('this torch\'s varlen_attn has no window_size: use backend="triton" or "flex"')
    else:
        kwargs = {"is_causal": causal}  # torch 2.9 / 2.10
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:  # torch <= 2.11: no enable_gqa, K/V need a head per query head
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    if sinks is not None:
        if "return_aux" not in params:
            raise RuntimeError('this torch\'s varlen_attn returns no log-sum-exp for the sinks: use backend="triton" '
                               'or "flex"')
        kwargs["return_aux"] = varlen.AuxRequest(lse=True)
    out = varlen.varlen_attn(q, k, _pad_values(q, v), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale,
                             **kwargs)
    return out if sinks is not None else (out, None)


def varlen_attention_library(backend, q, k, v, cu_seqlens, max_seqlen, causal, scale, window=None, sinks=None):
    """q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, Dv) -> (T, Hq, Dv) with `backend` "torch_varlen",
    "flash_attn" or "flex"; `window`: keys i - window < j <= i; `sinks`: (Hq,) logits."""
    dv = v.shape[-1]
    # FlashAttention's window (left, right) counts keys besides the query's own: W keys = W - 1 left
    left = -1 if window is None else window - 1
    if backend == "torch_varlen":
        out, lse = _torch_varlen(q, k, v, cu_seqlens, max_seqlen, causal, scale, left, sinks)
    elif backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        res = flash_attn_varlen_func(q, k, _pad_values(q, v), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                     softmax_scale=scale, causal=causal, window_size=(left, 0 if causal else -1),
                                     return_attn_probs=sinks is not None)
        out, lse = (res[0], res[1]) if sinks is not None else (res, None)
    else:
        out, lse = _flex(q, k, v, cu_seqlens, causal, scale, window, sinks is not None)
    out = out[..., :dv]
    return out if sinks is None else apply_sinks(out, lse, sinks)


def _flex(q, k, v, cu_seqlens, causal, scale, window, return_lse):
    from ..common.flex import flex_attention_packed, packed_block_mask

    t = q.shape[0]

    def document_mask():
        doc = torch.repeat_interleave(torch.arange(cu_seqlens.numel() - 1, device=q.device),
                                      (cu_seqlens[1:] - cu_seqlens[:-1]).long(), output_size=t)

        def mask_mod(b, h, i, j):
            same = doc[i] == doc[j]
            if window is not None:
                same = same & (i - j < window)
            return same & (j <= i) if causal else same
        return mask_mod

    mask = packed_block_mask((cu_seqlens,), ("varlen", t, causal, window), document_mask, t, t)
    out = flex_attention_packed(q, k, v, mask, scale, return_lse=return_lse)
    return out if return_lse else (out, None)
