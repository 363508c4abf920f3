"""DFlash block attention through FlexAttention with a block mask (the `backend="flex"` path)."""
from __future__ import annotations

import torch

from ..common.flex import flex_attention_packed, packed_block_mask


def dflash_block_attention_flex(q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens, block_seq, block_anchor, block_size,
                                scale, window=None, causal=False):
    """Keys are all context rows followed by all block rows; the mask keeps, for slot k of block j
    (sample s, anchor a; position a+k), the context rows of s before a and the slots of block j,
    each limited as `window` / `causal` say (see `dflash_block_attention`). The mask is built once
    per batch and layer rule (packed_block_mask)."""
    total, rows = k_ctx.shape[0], q.shape[0]

    def block_mask():
        doc = torch.repeat_interleave(torch.arange(cu_seqlens.numel() - 1, device=q.device),
                                      (cu_seqlens[1:] - cu_seqlens[:-1]).long(), output_size=total)
        pos = torch.arange(total, device=q.device) - cu_seqlens.long()[doc]
        seq, anchor = block_seq.long(), block_anchor.long()

        def mask_mod(b, h, i, j):
            blk, k = i // block_size, i % block_size
            jc = torch.clamp(j, max=max(total - 1, 0))
            ctx_ok = (doc[jc] == seq[blk]) & (pos[jc] < anchor[blk])
            slot = (j - total) % block_size
            own_ok = (j - total) // block_size == blk
            if window is not None:
                ctx_ok = ctx_ok & (pos[jc] > anchor[blk] + k - window)
                own_ok = own_ok & (k - slot < window)
                if not causal:
                    own_ok = own_ok & (slot - k < window)
            if causal:
                own_ok = own_ok & (slot <= k)
            return torch.where(j < total, ctx_ok, own_ok)
        return mask_mod

    mask = packed_block_mask((cu_seqlens, block_seq, block_anchor), ("block", block_size, total, rows, window, causal),
                             block_mask, rows, total + rows)
    return flex_attention_packed(q, torch.cat([k_ctx, k_blk]), torch.cat([v_ctx, v_blk]), mask, scale)
