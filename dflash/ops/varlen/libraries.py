"""Packed varlen attention through public kernels: torch's varlen_attn, flash-attn's
flash_attn_varlen_func and FlexAttention with a document mask (the `backend=` alternatives)."""
from __future__ import annotations

import functools
import inspect

import torch


@functools.cache
def _parameters(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def varlen_attention_library(backend, q, k, v, cu_seqlens, max_seqlen, causal, scale):
    """q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D) with `backend` "torch_varlen", "flash_attn" or "flex"."""
    if backend == "torch_varlen":
        from torch.nn.attention.varlen import varlen_attn

        params = _parameters(varlen_attn)
        kwargs = {"window_size": (-1, 0) if causal else (-1, -1)} if "window_size" in params else {
            "is_causal": causal}  # torch 2.9 / 2.10
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        elif k.shape[1] != q.shape[1]:  # torch <= 2.11: no enable_gqa, K/V need a head per query head
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, **kwargs)
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale,
                                      causal=causal)
    from ..common.flex import flex_attention_packed, packed_block_mask

    t = q.shape[0]

    def document_mask():
        doc = torch.repeat_interleave(torch.arange(cu_seqlens.numel() - 1, device=q.device),
                                      (cu_seqlens[1:] - cu_seqlens[:-1]).long(), output_size=t)

        def mask_mod(b, h, i, j):
            same = doc[i] == doc[j]
            return same & (j <= i) if causal else same
        return mask_mod

    mask = packed_block_mask((cu_seqlens,), ("varlen", t, causal), document_mask, t, t)
    return flex_attention_packed(q, k, v, mask, scale)
