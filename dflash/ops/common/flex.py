"""FlexAttention over packed rows: (rows, heads, dim) tensors and a mask_mod over row indices."""
from __future__ import annotations

import torch

_COMPILED = {}


def flex_attention_packed(q, k, v, mask_mod, scale, return_lse: bool = False):
    """q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv) -> (Tq, Hq, Dv); mask_mod(b, h, i, j) says row i
    sees key j. With `return_lse`, also the (Hq, Tq) log-sum-exp (natural log) of the visible scores.

    On CUDA flex_attention is compiled (its fused kernel); on the CPU it runs eagerly, forward
    only (torch has no CPU backward for it)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    fn = flex_attention
    if q.device.type == "cuda":
        # Default dynamic=None: after the first new shape torch.compile makes lengths dynamic
        # instead of recompiling for every batch.
        fn = _COMPILED.setdefault("fn", torch.compile(flex_attention))
    mask = create_block_mask(mask_mod, None, None, q.shape[0], k.shape[0], device=q.device)
    out = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask,
             scale=scale, enable_gqa=True, return_lse=return_lse)
    if return_lse:
        return out[0][0].transpose(0, 1), out[1][0]
    return out[0].transpose(0, 1)
