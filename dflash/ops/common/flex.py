"""FlexAttention over packed rows: (rows, heads, dim) tensors and a block mask over row indices."""
from __future__ import annotations

from collections.abc import Callable

import torch

from .tiles import TILE_CACHE

_COMPILED = {}


def packed_block_mask(tensors: tuple, params: tuple, mask_mod: Callable[[], Callable], q_len: int, kv_len: int):
    """The BlockMask of one batch, built once: cached on the batch's index `tensors` (the same
    objects, unmodified) and `params`, as the Triton tile lists are, so a model's layers (and a
    benchmark's timed calls) reuse it. `mask_mod()` returns mask_mod(b, h, i, j): row i sees key j."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = tensors[0].device
    return TILE_CACHE.get(tensors, ("flex", *params),
                          lambda: create_block_mask(mask_mod(), None, None, q_len, kv_len, device=device))


def flex_attention_packed(q, k, v, block_mask, scale, return_lse: bool = False):
    """q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv) -> (Tq, Hq, Dv) under `block_mask`
    (packed_block_mask). With `return_lse`, also the (Hq, Tq) log-sum-exp (natural log) of the
    visible scores.

    On CUDA flex_attention is compiled (its fused kernel); on the CPU it runs eagerly, forward
    only (torch has no CPU backward for it)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.device.type == "cuda":
        # Default dynamic=None: after the first new shape torch.compile makes lengths dynamic
        # instead of recompiling for every batch.
        fn = _COMPILED.setdefault("fn", torch.compile(flex_attention))
    out = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=block_mask,
             scale=scale, enable_gqa=True, return_lse=return_lse)
    if return_lse:
        return out[0][0].transpose(0, 1), out[1][0]
    return out[0].transpose(0, 1)
