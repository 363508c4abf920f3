"""Plain-PyTorch reference for DFlash block attention: one sample at a time.

For the blocks of one sample, the scores against the sample's context rows that any of its
blocks can see (masked per row) and against each block's own B keys are concatenated along the
key axis and share one softmax. Memory is (blocks of the sample) x heads x B x (context span + B):
per sample, never a dense mask over the whole pack.
"""
from __future__ import annotations

import torch


def block_visibility(block_size: int, window: int | None, causal: bool, device=None) -> torch.Tensor:
    """(B, B) bool: slot k (row) sees slot i (column) of its own block. Slot i is at position a+i."""
    k = torch.arange(block_size, device=device)[:, None]
    i = torch.arange(block_size, device=device)[None, :]
    ok = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    if causal:
        ok &= i <= k
    if window is not None:
        ok &= k - i < window
        if not causal:
            ok &= i - k < window
    return ok


def dflash_block_attention_naive(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    cu_seqlens_ctx: torch.Tensor,
    block_seq: torch.Tensor,
    block_anchor: torch.Tensor,
    block_size: int,
    softmax_scale: float | None = None,
    window: int | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """q/k_blk/v_blk (NB*B, H*, D), k_ctx/v_ctx (T, Hkv, D) -> (NB*B, Hq, D)."""
    B = block_size
    NB = block_seq.numel()
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_ctx.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax in at least fp32
    qb = q.view(NB, B, Hkv, G, D)
    kb = k_blk.view(NB, B, Hkv, D)
    vb = v_blk.view(NB, B, Hkv, D)
    if NB == 0:
        return q.new_zeros(q.shape)
    bounds = cu_seqlens_ctx.tolist()  # host sync: the reference loops on the host anyway
    slot = torch.arange(B, device=q.device)
    own = block_visibility(B, window, causal, q.device)  # (B, B)
    outs, order = [], []
    for s in torch.unique(block_seq).tolist():
        idx = torch.nonzero(block_seq == s).flatten()
        anchors = block_anchor[idx].long()
        bos, eos = bounds[s], bounds[s + 1]
        a_max = int(anchors.max())
        if a_max > eos - bos:
            raise ValueError(f"an anchor of sample {s} lies past its length {eos - bos}")
        # Context rows some block of this sample can see: [lo, a_max). Slot k at position a+k
        # sees context positions j < a, and with a window only j > a+k-window.
        lo = 0 if window is None else max(0, int(anchors.min()) - window + 1)
        kc, vc = k_ctx[bos + lo:bos + a_max], v_ctx[bos + lo:bos + a_max]  # (A, Hkv, D)
        qs = qb[idx]  # (n, B, Hkv, G, D)
        s_ctx = torch.einsum("nbkgd,ckd->nkgbc", qs, kc).to(acc) * scale
        pos = torch.arange(lo, a_max, device=q.device)[None, None, :]  # (1, 1, A)
        visible = pos < anchors[:, None, None]  # (n, B, A)
        if window is not None:
            visible = visible & (pos > anchors[:, None, None] + slot[None, :, None] - window)
        s_ctx = s_ctx.masked_fill(~visible[:, None, None], float("-inf"))
        s_blk = torch.einsum("nbkgd,nckd->nkgbc", qs, kb[idx]).to(acc) * scale
        s_blk = s_blk.masked_fill(~own, float("-inf"))
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1).to(v_ctx.dtype)
        A = a_max - lo
        o = torch.einsum("nkgbc,ckd->nbkgd", p[..., :A], vc)
        o = o + torch.einsum("nkgbc,nckd->nbkgd", p[..., A:], vb[idx])
        outs.append(o)
        order.append(idx)
    out = torch.cat(outs)[torch.argsort(torch.cat(order))]  # back to block order
    return out.reshape(NB * B, Hq, D)
