"""Triton kernels for DFlash block attention: forward, and a backward in two or three kernels:
dK/dV of the context (with dQ accumulated from it by atomics, or deterministic: dQ from the
context in a kernel of its own), then dQ's own-block part with dK/dV of the blocks' own keys.

Layout: q (NB*B, HQ, D) with block j on rows [j*B, (j+1)*B); k_blk/v_blk (NB*B, HKV, D);
k_ctx/v_ctx (T, HKV, D) packed by cu_seqlens; lse/delta (HQ, NB*B) fp32 (n_rows = NB*B: a
group's rows load contiguously), lse in base 2.

A query tile is a *group*: up to BPG = BLOCK_M // B blocks of one sample with neighbouring
anchors (common.tiles.block_groups), gathered by block id. Its keys are
  * the sample's context [0, amax): tiles ending at or before amin are visible to every row
    and skip masking; the rest are masked per row at the row's anchor;
  * the group's own block rows (a BLOCK_M x BLOCK_M tile, block-diagonal mask).
Nothing length-dependent is a kernel argument (no recompiles across batches).

Sliding variants (a drafter's sliding_attention layers, docs/ARCHITECTURE.md "Drafter layer
types"): HAS_WINDOW limits slot k of a block anchored at a to context positions >= a+k-window+1
(and its own slots to k-window < i), CAUSAL to its slots i <= k. A group then reads the context
from amin-window+1 only, and every row is masked outside [amax+B-window, amin).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...errors import UserError
from ..common.backend import is_interpreting
from ..common.compile_check import fitting_configs
from ..common.delta import attention_delta
from ..common.tiles import TILE_CACHE, block_groups, context_group_ranges, longest_sample, sequence_tiles
from ..common.triton_utils import (
    LOG2E,
    autotune,
    check_triton_inputs,
    launch,
    offsets_need_int64,
    size_bucket,
    tile_rows,
)

GROUP_ROWS = 16 if is_interpreting() else 64  # smallest BLOCK_M of a group (more if B is larger), before tile_rows
CTX_BLOCK_N = 16 if is_interpreting() else 128  # context tile of the dK/dV kernel (tile list), before tile_rows
CTX_ROW_BYTES = 128  # halve CTX_BLOCK_N per doubling above this: its dK/dV accumulators spill at 128 rows
_CTX_STEP = [16] if is_interpreting() else [32, 64, 128]  # context step of forward and dQ (autotuned)
# n_bucket: size_bucket(rows), tuned per size class; every variant flag is in the key, so that one
# variant's tuning never picks the config of another (which may spill or not fit).
_KEY = ["HQ", "HKV", "D", "B", "OFFS64", "HAS_WINDOW", "CAUSAL", "n_bucket"]
BLOCK_FALLBACK = 'backend="flex" (FlexAttention) or the reference "torch"'


@triton.jit
def _group_rows(grp_blocks, block_anchor, i_g, part, B: tl.constexpr, BPG: tl.constexpr, BLOCK_M: tl.constexpr,
                PER_PART: tl.constexpr, OFFS64: tl.constexpr):
    """Row indices, validity, anchors and slots of the query rows of group i_g's blocks
    [part * PER_PART, (part + 1) * PER_PART) (all of them: part 0, PER_PART = BPG), BLOCK_M rows.
    The rows are int64 only when offsets need it (OFFS64: the block tensors or a context sample
    reach 2**31 elements): int64 offset tensors cost registers, enough to make every config spill."""
    r = tl.arange(0, BLOCK_M)
    local = r // B
    slot = part * PER_PART + local
    blk = tl.load(grp_blocks + i_g * BPG + slot, mask=(local < PER_PART) & (slot < BPG), other=-1)
    ok = blk >= 0
    if OFFS64:
        rows = blk.to(tl.int64) * B + r % B
    else:
        rows = blk * B + r % B
    anchor = tl.load(block_anchor + blk, mask=ok, other=0)
    return rows, ok, anchor, slot


@triton.jit
def _window_start(anchor, amin, amax, window, B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_WINDOW: tl.constexpr):
    """(first, lo, full_lo, full_hi): each row's first visible context position, and the context
    tiles of a group: [lo, full_lo) and [full_hi, amax) masked per row, [full_lo, full_hi) seen
    by every row (rows see [first, anchor); first = anchor + slot - window + 1 with a window)."""
    full_hi = (amin // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        first = anchor + tl.arange(0, BLOCK_M) % B - window + 1
        lo = (tl.maximum(amin - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(amax + B - window, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), full_hi)
    else:
        first = anchor
        lo = 0
        full_lo = 0
    return first, lo, full_lo, full_hi


@triton.jit
def _sees_context(cols, anchor, first, HAS_WINDOW: tl.constexpr):
    """(rows, cols) visibility of context columns: before the anchor, and inside the window."""
    vis = cols[None, :] < anchor[:, None]
    if HAS_WINDOW:
        vis = vis & (cols[None, :] >= first[:, None])
    return vis


@triton.jit
def _sees_own(same, slot_q, slot_k, window, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """`same` (query rows x key rows of the same block) limited by the rule of the layer: slot_q /
    slot_k are the rows' slots inside their blocks."""
    if CAUSAL:
        same = same & (slot_k[None, :] <= slot_q[:, None])
    if HAS_WINDOW:
        same = same & (slot_q[:, None] - slot_k[None, :] < window)
        if not CAUSAL:
            same = same & (slot_k[None, :] - slot_q[:, None] < window)
    return same


@triton.jit
def _masked_load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _per_row(x, CHUNKS: tl.constexpr):
    """A vector over the query rows, shaped to broadcast against the output accumulator."""
    if CHUNKS > 2:  # one return: Triton checks every return's type, even in a branch not taken
        y = x[None, :, None]
    else:
        y = x[:, None]
    return y


@triton.jit
def _acc_cols(D: tl.constexpr, CHUNKS: tl.constexpr):
    """Head-dim column of each accumulator element (broadcast over the rows): (1, DH), or with more
    than two chunks (CHUNKS, 1, DH), chunk c holding columns [c DH, (c + 1) DH)."""
    DH: tl.constexpr = D // CHUNKS
    if CHUNKS > 2:
        cols = tl.arange(0, CHUNKS)[:, None, None] * DH + tl.arange(0, DH)[None, None, :]
    else:
        cols = tl.arange(0, DH)[None, :]
    return cols


@triton.jit
def _add_pv(acc, acc_hi, alpha, p, v_ptrs, v_mask, MASKED: tl.constexpr, D: tl.constexpr, CHUNKS: tl.constexpr):
    """acc * alpha + p @ v over the columns of _acc_cols (v_ptrs, v_mask shaped alike), and with two
    chunks v's columns [D/2, D) into acc_hi. More chunks make one batched dot, p repeated per chunk."""
    if CHUNKS > 2:
        p = tl.broadcast_to(p[None, :, :], (CHUNKS, p.shape[0], p.shape[1]))
    acc = acc * _per_row(alpha, CHUNKS) + tl.dot(p, _masked_load(v_ptrs, v_mask, MASKED))
    if CHUNKS == 2:
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p, _masked_load(v_ptrs + D // 2, v_mask, MASKED))
    return acc, acc_hi


@triton.jit
def _fwd_ctx(q, kc_base, vc_base, n_lo, n_hi, amax, anchor, first, m_i, l_i, acc, acc_hi, qk_scale,
             HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, OFFS64: tl.constexpr, MASKED: tl.constexpr,
             HAS_WINDOW: tl.constexpr, CHUNKS: tl.constexpr):
    """Online softmax over the context tiles [n_lo, n_hi): every column seen by every row, or
    (MASKED) as _sees_context says, with columns past amax not loaded."""
    offs_d = tl.arange(0, D)
    acc_cols = _acc_cols(D, CHUNKS)
    offs_n = tl.arange(0, BLOCK_N)
    if OFFS64:
        offs_n = offs_n.to(tl.int64)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        cols = n0 + offs_n
        v_ptrs = vc_base + _per_row(cols, CHUNKS) * (HKV * D) + acc_cols
        col_ok = cols < amax  # (MASKED only)
        if MASKED:
            kT = tl.load(kc_base + cols[None, :] * (HKV * D) + offs_d[:, None], mask=col_ok[None, :], other=0.0)
            s = tl.dot(q, kT)  # scaled inside exp2 below: one FMA per score
            s = tl.where(_sees_context(cols, anchor, first, HAS_WINDOW), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        else:
            kT = tl.load(kc_base + cols[None, :] * (HKV * D) + offs_d[:, None])
            s = tl.dot(q, kT)
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_safe = m_new
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s * qk_scale - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc, acc_hi = _add_pv(acc, acc_hi, alpha, p.to(kT.dtype), v_ptrs, _per_row(col_ok, CHUNKS), MASKED, D,
                              CHUNKS)
        m_i = m_new
    return m_i, l_i, acc, acc_hi


@triton.jit
def _dq_ctx(q, do, lse, delta, dq, kc_base, vc_base, n_lo, n_hi, amax, anchor, first, qk_scale,
            HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, OFFS64: tl.constexpr, MASKED: tl.constexpr,
            HAS_WINDOW: tl.constexpr):
    """dQ (unscaled) from the context tiles [n_lo, n_hi), masked as in _fwd_ctx."""
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    if OFFS64:
        offs_n = offs_n.to(tl.int64)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        cols = n0 + offs_n
        if MASKED:
            col_ok = cols < amax
            kT = tl.load(kc_base + cols[None, :] * (HKV * D) + offs_d[:, None], mask=col_ok[None, :], other=0.0)
            vT = tl.load(vc_base + cols[None, :] * (HKV * D) + offs_d[:, None], mask=col_ok[None, :], other=0.0)
            p = tl.math.exp2(tl.dot(q, kT) * qk_scale - lse[:, None])
            p = tl.where(_sees_context(cols, anchor, first, HAS_WINDOW), p, 0.0)
        else:
            kT = tl.load(kc_base + cols[None, :] * (HKV * D) + offs_d[:, None])
            vT = tl.load(vc_base + cols[None, :] * (HKV * D) + offs_d[:, None])
            p = tl.math.exp2(tl.dot(q, kT) * qk_scale - lse[:, None])
        ds = p * (tl.dot(do, vT) - delta[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))
    return dq


# 8 warps first (the gate's --first-only): under Triton 3.6 the first 4-warp config spills on sm_120a at head dim 256.
@autotune({"BLOCK_N": _CTX_STEP, "num_warps": [8, 4], "num_stages": [1, 2, 3]}, _KEY, BLOCK_FALLBACK)
@triton.jit(do_not_specialize=["n_bucket", "n_rows", "n_window"])
def _fwd_kernel(Q, KC, VC, KB, VB, OUT, LSE, cu_seqlens, block_anchor, grp_blocks, grp_seq, grp_amin, grp_amax,
                grp_order, qk_scale, n_window, n_bucket, n_rows,
                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, B: tl.constexpr, BPG: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OFFS64: tl.constexpr, HAS_WINDOW: tl.constexpr,
                CAUSAL: tl.constexpr, CHUNKS: tl.constexpr):
    pid = tl.program_id(0)
    i_g = tl.load(grp_order + pid // HQ)
    i_h = pid % HQ
    seq = tl.load(grp_seq + i_g)
    if seq < 0:  # sentinel group
        return
    i_kh = i_h // (HQ // HKV)
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    amin = tl.load(grp_amin + i_g)
    amax = tl.load(grp_amax + i_g)
    rows, ok, anchor, slot = _group_rows(grp_blocks, block_anchor, i_g, 0, B, BPG, BLOCK_M, BPG, OFFS64)
    offs_d = tl.arange(0, D)
    q_off = rows[:, None] * (HQ * D) + i_h * D + offs_d[None, :]
    q = tl.load(Q + q_off, mask=ok[:, None], other=0.0)
    kc_base = KC + bos * (HKV * D) + i_kh * D
    vc_base = VC + bos * (HKV * D) + i_kh * D

    DH: tl.constexpr = D // CHUNKS
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if CHUNKS > 2:
        acc = tl.zeros([CHUNKS, BLOCK_M, DH], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, DH], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, DH], tl.float32)  # columns [DH, D) with two chunks, else unused
    first, lo, full_lo, full_hi = _window_start(anchor, amin, amax, n_window, B, BLOCK_M, BLOCK_N, HAS_WINDOW)
    m_i, l_i, acc, acc_hi = _fwd_ctx(q, kc_base, vc_base, full_lo, full_hi, amax, anchor, first, m_i, l_i, acc,
                                     acc_hi, qk_scale, HKV, D, BLOCK_N, OFFS64, False, HAS_WINDOW, CHUNKS)
    m_i, l_i, acc, acc_hi = _fwd_ctx(q, kc_base, vc_base, lo, full_lo, amax, anchor, first, m_i, l_i, acc,
                                     acc_hi, qk_scale, HKV, D, BLOCK_N, OFFS64, True, HAS_WINDOW, CHUNKS)
    m_i, l_i, acc, acc_hi = _fwd_ctx(q, kc_base, vc_base, full_hi, amax, amax, anchor, first, m_i, l_i, acc,
                                     acc_hi, qk_scale, HKV, D, BLOCK_N, OFFS64, True, HAS_WINDOW, CHUNKS)
    # The group's own blocks: each row sees the rows of its block that the layer's rule allows.
    kb_off = rows[None, :] * (HKV * D) + i_kh * D + offs_d[:, None]
    kbT = tl.load(KB + kb_off, mask=ok[None, :], other=0.0)  # (D, BLOCK_M)
    s = tl.dot(q, kbT)  # scaled inside exp2 below: one FMA per score
    in_block = tl.arange(0, BLOCK_M) % B
    own = _sees_own((slot[:, None] == slot[None, :]) & ok[None, :], in_block, in_block, n_window, HAS_WINDOW, CAUSAL)
    s = tl.where(own, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows of a partial group
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc_cols = _acc_cols(D, CHUNKS)
    vb_ptrs = VB + _per_row(rows, CHUNKS) * (HKV * D) + i_kh * D + acc_cols
    acc, acc_hi = _add_pv(acc, acc_hi, alpha, p.to(kbT.dtype), vb_ptrs, _per_row(ok, CHUNKS), True, D, CHUNKS)
    m_i = m_new

    l_i = tl.where(ok, l_i, 1.0)  # padding rows (never stored) would divide 0 by 0
    out_ptrs = OUT + _per_row(rows, CHUNKS) * (HQ * D) + i_h * D + acc_cols
    tl.store(out_ptrs, (acc / _per_row(l_i, CHUNKS)).to(OUT.dtype.element_ty), mask=_per_row(ok, CHUNKS))
    if CHUNKS == 2:
        tl.store(out_ptrs + DH, (acc_hi / l_i[:, None]).to(OUT.dtype.element_ty), mask=ok[:, None])
    tl.store(LSE + i_h * n_rows + rows, m_i + tl.math.log2(l_i), mask=ok)


# dQ is accumulated into DQ_ACC: the autotuner must zero it after timing the configs on the live buffers.
# Each kernel's first config fits every GPU of compile_check.MAX_SHARED (the gate's --first-only):
# on sm_120a 4 warps spill here, 1 stage in the dQ kernel.
@autotune({"num_warps": [8, 4], "num_stages": [1, 2, 3]}, _KEY + ["FUSED_DQ"], BLOCK_FALLBACK,
          reset_to_zero=["DQ_ACC"])
@triton.jit(do_not_specialize=["n_bucket", "n_rows", "n_window"])
def _bwd_ctx_kernel(Q, KC, VC, DO, LSE, DELTA, DKC, DVC, DQ_ACC, cu_seqlens, block_anchor, grp_blocks, tiles, ranges,
                    qk_scale, sm_scale, n_window, n_bucket, n_rows,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, B: tl.constexpr, BPG: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OFFS64: tl.constexpr, FUSED_DQ: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    # One program: BLOCK_N context keys of one kv head. Groups [lo, full) see part of them,
    # [full, end) all of them (ranges from common.tiles.context_group_ranges); keys nobody
    # sees get zero gradients. GQA heads are summed here (no atomics). With FUSED_DQ the
    # groups' dQ from these keys is added to DQ_ACC (fp32, unscaled) with atomics: 5 GEMMs per
    # tile pair instead of 4 here and 3 more in _bwd_dq_ctx_kernel, but the order of the
    # additions, hence the last bits of dQ, varies from run to run.
    pid = tl.program_id(0)
    i_tile, i_kh = pid // HKV, pid % HKV
    seq = tl.load(tiles + 2 * i_tile)
    if seq < 0:
        return
    G: tl.constexpr = HQ // HKV
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    L = tl.load(cu_seqlens + seq + 1) - bos.to(tl.int32)
    cols = tl.load(tiles + 2 * i_tile + 1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if OFFS64:
        cols = cols.to(tl.int64)
    g_lo = tl.load(ranges + 3 * i_tile)
    g_full = tl.load(ranges + 3 * i_tile + 1)
    g_end = tl.load(ranges + 3 * i_tile + 2)
    offs_d = tl.arange(0, D)
    col_ok = cols < L
    kv_base = bos * (HKV * D) + i_kh * D  # int64 scalar; the tile offsets stay int32 (fewer registers)
    kv_off = cols[:, None] * (HKV * D) + offs_d[None, :]
    k = tl.load(KC + kv_base + kv_off, mask=col_ok[:, None], other=0.0)
    v = tl.load(VC + kv_base + kv_off, mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    # Padding rows of a group load as zeros (q, dO, lse, delta) and add exactly nothing. With a
    # window every group is in [lo, full): context_group_ranges leaves none fully visible.
    in_block = tl.arange(0, BLOCK_M) % B
    for g in range(G):
        i_h = i_kh * G + g
        for i_g in range(g_lo, g_end):
            rows, ok, anchor, slot = _group_rows(grp_blocks, block_anchor, i_g, 0, B, BPG, BLOCK_M, BPG, OFFS64)
            q_off = rows[:, None] * (HQ * D) + i_h * D + offs_d[None, :]
            q = tl.load(Q + q_off, mask=ok[:, None], other=0.0)
            do = tl.load(DO + q_off, mask=ok[:, None], other=0.0)
            lse = tl.load(LSE + i_h * n_rows + rows, mask=ok, other=0.0)
            delta = tl.load(DELTA + i_h * n_rows + rows, mask=ok, other=0.0)
            pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])  # (BLOCK_N, BLOCK_M)
            if i_g < g_full:  # partly visible: each row sees the keys before its anchor (and in its window)
                vis = cols[:, None] < anchor[None, :]
                if HAS_WINDOW:
                    vis = vis & (cols[:, None] >= (anchor + in_block - n_window + 1)[None, :])
                pT = tl.where(vis, pT, 0.0)
            dv += tl.dot(pT.to(do.dtype), do)
            dsT = pT * (tl.dot(v, tl.trans(do)) - delta[None, :])
            dk += tl.dot(dsT.to(q.dtype), q)
            if FUSED_DQ:
                tl.atomic_add(DQ_ACC + q_off, tl.dot(tl.trans(dsT.to(k.dtype)), k), mask=ok[:, None], sem="relaxed")
    tl.store(DKC + kv_base + kv_off, (dk * sm_scale).to(DKC.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DVC + kv_base + kv_off, dv.to(DVC.dtype.element_ty), mask=col_ok[:, None])


@autotune({"BLOCK_N": _CTX_STEP, "num_warps": [4, 8], "num_stages": [2, 3, 1]}, _KEY, BLOCK_FALLBACK)
@triton.jit(do_not_specialize=["n_bucket", "n_rows", "n_window"])
def _bwd_dq_ctx_kernel(Q, KC, VC, DO, LSE, DELTA, DQ_ACC, cu_seqlens, block_anchor, grp_blocks, grp_seq, grp_amin,
                       grp_amax, grp_order, qk_scale, n_window, n_bucket, n_rows,
                       HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, B: tl.constexpr, BPG: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OFFS64: tl.constexpr, HAS_WINDOW: tl.constexpr,
                       CAUSAL: tl.constexpr):
    # Deterministic dQ from the context: one program per group and query head recomputes the
    # scores and dP of every context tile it sees (3 GEMMs) and writes DQ_ACC (fp32, unscaled).
    pid = tl.program_id(0)
    i_g = tl.load(grp_order + pid // HQ)
    i_h = pid % HQ
    seq = tl.load(grp_seq + i_g)
    if seq < 0:
        return
    i_kh = i_h // (HQ // HKV)
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    amin = tl.load(grp_amin + i_g)
    amax = tl.load(grp_amax + i_g)
    rows, ok, anchor, slot = _group_rows(grp_blocks, block_anchor, i_g, 0, B, BPG, BLOCK_M, BPG, OFFS64)
    offs_d = tl.arange(0, D)
    kc_base = KC + bos * (HKV * D) + i_kh * D
    vc_base = VC + bos * (HKV * D) + i_kh * D
    q_off = rows[:, None] * (HQ * D) + i_h * D + offs_d[None, :]
    q = tl.load(Q + q_off, mask=ok[:, None], other=0.0)
    do = tl.load(DO + q_off, mask=ok[:, None], other=0.0)
    lse = tl.load(LSE + i_h * n_rows + rows, mask=ok, other=0.0)
    delta = tl.load(DELTA + i_h * n_rows + rows, mask=ok, other=0.0)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    first, lo, full_lo, full_hi = _window_start(anchor, amin, amax, n_window, B, BLOCK_M, BLOCK_N, HAS_WINDOW)
    dq = _dq_ctx(q, do, lse, delta, dq, kc_base, vc_base, full_lo, full_hi, amax, anchor, first, qk_scale,
                 HKV, D, BLOCK_N, OFFS64, False, HAS_WINDOW)
    dq = _dq_ctx(q, do, lse, delta, dq, kc_base, vc_base, lo, full_lo, amax, anchor, first, qk_scale,
                 HKV, D, BLOCK_N, OFFS64, True, HAS_WINDOW)
    dq = _dq_ctx(q, do, lse, delta, dq, kc_base, vc_base, full_hi, amax, amax, anchor, first, qk_scale,
                 HKV, D, BLOCK_N, OFFS64, True, HAS_WINDOW)
    tl.store(DQ_ACC + q_off, dq, mask=ok[:, None])


@autotune({"num_warps": [4, 8], "num_stages": [1, 2]}, _KEY, BLOCK_FALLBACK)
@triton.jit(do_not_specialize=["n_bucket", "n_rows", "n_window"])
def _bwd_own_kernel(Q, KB, VB, DO, LSE, DELTA, DQ_ACC, DQ, DKB, DVB, block_anchor, grp_blocks, grp_seq, grp_order,
                    qk_scale, sm_scale, n_window, n_bucket, n_rows,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, B: tl.constexpr, BPG: tl.constexpr,
                    OWN_M: tl.constexpr, PER_PART: tl.constexpr, OFFS64: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    CAUSAL: tl.constexpr):
    # One program: PER_PART blocks (OWN_M rows) of a group and one kv head, looping over its
    # query heads. The blocks' own keys are seen by their own block only, so their dK/dV
    # (summed over the query heads) are finished here, and dQ = (context part from DQ_ACC + own
    # part) * scale is written. Blocks are independent here, so a group is split into parts:
    # half-size tiles keep every head-dim-128 config from spilling.
    PARTS: tl.constexpr = (BPG + PER_PART - 1) // PER_PART
    pid = tl.program_id(0)
    i_g = tl.load(grp_order + pid // (HKV * PARTS))
    i_kh = (pid // PARTS) % HKV
    seq = tl.load(grp_seq + i_g)
    if seq < 0:
        return
    G: tl.constexpr = HQ // HKV
    rows, ok, anchor, slot = _group_rows(grp_blocks, block_anchor, i_g, pid % PARTS, B, BPG, OWN_M, PER_PART,
                                         OFFS64)
    offs_d = tl.arange(0, D)
    kb_off = rows[:, None] * (HKV * D) + i_kh * D + offs_d[None, :]
    kb = tl.load(KB + kb_off, mask=ok[:, None], other=0.0)  # (OWN_M, D)
    vb = tl.load(VB + kb_off, mask=ok[:, None], other=0.0)
    in_block = tl.arange(0, OWN_M) % B
    own = _sees_own((slot[:, None] == slot[None, :]) & ok[None, :], in_block, in_block, n_window, HAS_WINDOW, CAUSAL)
    dkb = tl.zeros([OWN_M, D], tl.float32)
    dvb = tl.zeros([OWN_M, D], tl.float32)
    for g in range(G):
        i_h = i_kh * G + g
        q_off = rows[:, None] * (HQ * D) + i_h * D + offs_d[None, :]
        q = tl.load(Q + q_off, mask=ok[:, None], other=0.0)
        do = tl.load(DO + q_off, mask=ok[:, None], other=0.0)
        lse = tl.load(LSE + i_h * n_rows + rows, mask=ok, other=0.0)
        delta = tl.load(DELTA + i_h * n_rows + rows, mask=ok, other=0.0)
        p = tl.math.exp2(tl.dot(q, tl.trans(kb)) * qk_scale - lse[:, None])  # (OWN_M, OWN_M)
        p = tl.where(own, p, 0.0)
        ds = p * (tl.dot(do, tl.trans(vb)) - delta[:, None])
        dq = tl.load(DQ_ACC + q_off, mask=ok[:, None], other=0.0) + tl.dot(ds.to(kb.dtype), kb)
        tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=ok[:, None])
        dvb += tl.dot(tl.trans(p.to(do.dtype)), do)
        dkb += tl.dot(tl.trans(ds.to(q.dtype)), q)
    tl.store(DKB + kb_off, (dkb * sm_scale).to(DKB.dtype.element_ty), mask=ok[:, None])
    tl.store(DVB + kb_off, dvb.to(DVB.dtype.element_ty), mask=ok[:, None])


def _out_chunks(head_dim: int, block_m: int) -> int:
    """Chunks of BLOCK_M head-dim columns in which the forward keeps its output (CHUNKS). Triton lays
    the warps of chained dots (mma.sync) out along the longer side of the P @ V tile, so with
    head_dim > BLOCK_M every warp held all of q's rows (all 18 configs of the sliding forward spilled
    on sm_120a at head dim 128, bf16). Two chunks are two 2-D accumulators (square tiles: warps on
    the rows; wgmma / tcgen05 still serve them on sm_90a / sm_100a). More (head dim 256 in 32-row
    groups, where every arch runs mma.sync) are one batched 3-D dot, whose warps go on the chunks:
    with 32 rows, warps on the rows would each hold the whole head dim of the accumulator."""
    return max(head_dim // block_m, 1)


def _own_tile(block_m: int, block_size: int) -> tuple[int, int]:
    """(rows, blocks) of one _bwd_own_kernel program: half a group where a block fits in half."""
    own_m = max(triton.next_power_of_2(block_size), block_m // 2)
    return own_m, own_m // block_size


# (HAS_WINDOW, CAUSAL) of the layer types: full attention, a drafter's sliding layers, and the
# sliding layers of a drafter with `is_causal: false` (every layer of the released DFlash2 drafters).
VARIANTS = ((False, False), (True, True), (True, False))


def compile_cases(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype, block_size: int = 16,
                  variants=VARIANTS) -> list:
    """(autotuned kernel, constexprs) of every kernel as the launchers below call it, for each
    (HAS_WINDOW, CAUSAL) of `variants`."""
    block_m = max(tile_rows(GROUP_ROWS, head_dim, dtype), triton.next_power_of_2(block_size))
    cases = []
    for has_window, causal in variants:
        common = dict(HQ=heads, HKV=kv_heads, D=head_dim, B=block_size, BPG=block_m // block_size, BLOCK_M=block_m,
                      OFFS64=False, HAS_WINDOW=has_window, CAUSAL=causal)
        ctx = {**common, "BLOCK_N": tile_rows(CTX_BLOCK_N, head_dim, dtype, CTX_ROW_BYTES)}
        own_m, per_part = _own_tile(block_m, block_size)
        own = {**{k: v for k, v in common.items() if k != "BLOCK_M"}, "OWN_M": own_m, "PER_PART": per_part}
        cases += [(_fwd_kernel, {**common, "CHUNKS": _out_chunks(head_dim, block_m)}),
                  (_bwd_ctx_kernel, {**ctx, "FUSED_DQ": True}), (_bwd_ctx_kernel, {**ctx, "FUSED_DQ": False}),
                  (_bwd_dq_ctx_kernel, common), (_bwd_own_kernel, own)]
    return cases


@functools.cache
def unservable(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype, block_size: int, deterministic: bool,
               has_window: bool, causal: bool, cap: int) -> str | None:
    """Why the kernels that such a call launches cannot run on capability `cap` (no config fits in
    shared memory), or None. Compiles what the autotuner would compile at the launch anyway."""
    for tuner, constexprs in compile_cases(head_dim, heads, kv_heads, dtype, block_size, ((has_window, causal),)):
        if constexprs.get("FUSED_DQ", not deterministic) == deterministic or (
                tuner is _bwd_dq_ctx_kernel and not deterministic):
            continue
        try:
            fitting_configs(tuner, dtype, constexprs, cap)
        except UserError as err:
            return str(err)
    return None


def _offs64(q, k_ctx, cu_seqlens_cpu) -> bool:
    """Whether offsets into the block tensors (q, dO, dQ, k_blk, v_blk, lse: none larger than q) or
    inside a context sample can pass int32."""
    longest = k_ctx.shape[0] if cu_seqlens_cpu is None else longest_sample(cu_seqlens_cpu)
    return q.numel() >= 2**31 or offsets_need_int64(longest, k_ctx.shape[1], k_ctx.shape[2])


class _Schedule:
    """Which programs the kernels run for one batch's blocks, and in what order: the groups of
    blocks and the context tiles with the groups that see each (built with torch ops)."""

    def __init__(self, cu_seqlens, block_seq, block_anchor, block_size, total, group_rows, ctx_block, cu_seqlens_cpu,
                 window):
        num_seqs = cu_seqlens.numel() - 1
        self.block_m = max(group_rows, triton.next_power_of_2(block_size))
        self.per_group = self.block_m // block_size
        (self.blocks, self.seq, self.amin, self.amax,
         self.order) = block_groups(block_seq, block_anchor, num_seqs, self.per_group)
        # Context tiles cover every context row, so keys that no block sees get zero gradients.
        self.ctx_block = ctx_block
        tiles = sequence_tiles(cu_seqlens, ctx_block, total, False, cu_seqlens_cpu)
        ranges = context_group_ranges(tiles, ctx_block, self.seq, self.amin, self.amax, num_seqs, window)
        order = torch.argsort(ranges[:, 2] - ranges[:, 0], descending=True, stable=True)  # most groups first
        self.ctx_tiles, self.ctx_ranges = tiles[order].contiguous(), ranges[order].contiguous()


def _schedule(cu_seqlens, block_seq, block_anchor, block_size, total, group_rows, ctx_block,
              cu_seqlens_cpu, window) -> _Schedule:
    return TILE_CACHE.get((cu_seqlens, block_seq, block_anchor),
                          ("dflash_block", block_size, total, group_rows, ctx_block, window),
                          lambda: _Schedule(cu_seqlens, block_seq, block_anchor, block_size, total, group_rows,
                                            ctx_block, cu_seqlens_cpu, window))


def dflash_block_fwd(q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens, block_anchor, sched, block_size, scale, offs64,
                     deterministic, window=None, causal=False):
    _, HQ, D = q.shape
    HKV = k_ctx.shape[1]
    o = torch.empty_like(q)
    lse = torch.empty((HQ, q.shape[0]), dtype=torch.float32, device=q.device)
    launch(_fwd_kernel, (sched.order.numel() * HQ,),
           (q, k_ctx, v_ctx, k_blk, v_blk, o, lse, cu_seqlens, block_anchor, sched.blocks, sched.seq, sched.amin,
            sched.amax, sched.order, scale * LOG2E, window or 0, size_bucket(q.shape[0]), q.shape[0]),
           dict(HQ=HQ, HKV=HKV, D=D, B=block_size, BPG=sched.per_group, BLOCK_M=sched.block_m, OFFS64=offs64,
                HAS_WINDOW=window is not None, CAUSAL=causal, CHUNKS=_out_chunks(D, sched.block_m)),
           pinned=deterministic)
    return o, lse


def dflash_block_bwd(do, q, k_ctx, v_ctx, k_blk, v_blk, o, lse, cu_seqlens, block_anchor, sched, block_size,
                     scale, offs64, deterministic, window=None, causal=False):
    _, HQ, D = q.shape
    HKV = k_ctx.shape[1]
    delta = attention_delta(do, o, pinned=deterministic)  # rowsum(dO * O), (HQ, rows) fp32
    dq, dk_blk, dv_blk = torch.empty_like(q), torch.empty_like(k_blk), torch.empty_like(v_blk)
    dk_ctx, dv_ctx = torch.empty_like(k_ctx), torch.empty_like(v_ctx)
    # dQ from the context, fp32 and unscaled: accumulated with atomics by the dK/dV kernel, or
    # written by a kernel of its own in a fixed order (deterministic).
    dq_acc = (torch.empty if deterministic else torch.zeros)(q.shape, dtype=torch.float32, device=q.device)
    consts = dict(HQ=HQ, HKV=HKV, D=D, B=block_size, BPG=sched.per_group, OFFS64=offs64,
                  HAS_WINDOW=window is not None, CAUSAL=causal)
    n_window = window or 0
    bucket = size_bucket(q.shape[0])
    launch(_bwd_ctx_kernel, (sched.ctx_tiles.shape[0] * HKV,),
           (q, k_ctx, v_ctx, do, lse, delta, dk_ctx, dv_ctx, dq_acc, cu_seqlens, block_anchor, sched.blocks,
            sched.ctx_tiles, sched.ctx_ranges, scale * LOG2E, scale, n_window, bucket, q.shape[0]),
           dict(consts, BLOCK_M=sched.block_m, BLOCK_N=sched.ctx_block, FUSED_DQ=not deterministic),
           pinned=deterministic)
    if deterministic:
        launch(_bwd_dq_ctx_kernel, (sched.order.numel() * HQ,),
               (q, k_ctx, v_ctx, do, lse, delta, dq_acc, cu_seqlens, block_anchor, sched.blocks, sched.seq,
                sched.amin, sched.amax, sched.order, scale * LOG2E, n_window, bucket, q.shape[0]),
               dict(consts, BLOCK_M=sched.block_m), pinned=True)
    own_m, per_part = _own_tile(sched.block_m, block_size)
    launch(_bwd_own_kernel, (sched.order.numel() * HKV * triton.cdiv(sched.per_group, per_part),),
           (q, k_blk, v_blk, do, lse, delta, dq_acc, dq, dk_blk, dv_blk, block_anchor, sched.blocks, sched.seq,
            sched.order, scale * LOG2E, scale, n_window, bucket, q.shape[0]),
           dict(consts, OWN_M=own_m, PER_PART=per_part), pinned=deterministic)
    return dq, dk_ctx, dv_ctx, dk_blk, dv_blk


class DFlashBlockAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens, block_anchor, sched, block_size, scale, offs64,
                deterministic, window, causal):
        o, lse = dflash_block_fwd(q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens, block_anchor, sched, block_size, scale,
                                  offs64, deterministic, window, causal)
        ctx.save_for_backward(q, k_ctx, v_ctx, k_blk, v_blk, o, lse, cu_seqlens, block_anchor)
        ctx.args = (sched, block_size, scale, offs64, deterministic, window, causal)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k_ctx, v_ctx, k_blk, v_blk, o, lse, cu_seqlens, block_anchor = ctx.saved_tensors
        grads = dflash_block_bwd(do.contiguous(), q, k_ctx, v_ctx, k_blk, v_blk, o, lse, cu_seqlens,
                                 block_anchor, *ctx.args)
        return (*grads, None, None, None, None, None, None, None, None, None)


def dflash_block_attention_triton(q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens, block_seq, block_anchor, block_size,
                                  scale, cu_seqlens_cpu=None, deterministic=False, window=None, causal=False):
    check_triton_inputs(q)
    cu_seqlens, block_seq, block_anchor = cu_seqlens.contiguous(), block_seq.contiguous(), block_anchor.contiguous()
    d, dtype = q.shape[-1], q.dtype
    sched = _schedule(cu_seqlens, block_seq, block_anchor, block_size, k_ctx.shape[0], tile_rows(GROUP_ROWS, d, dtype),
                      tile_rows(CTX_BLOCK_N, d, dtype, CTX_ROW_BYTES), cu_seqlens_cpu, window)
    return DFlashBlockAttentionFunction.apply(q.contiguous(), k_ctx.contiguous(), v_ctx.contiguous(),
                                              k_blk.contiguous(), v_blk.contiguous(), cu_seqlens, block_anchor,
                                              sched, block_size, scale, _offs64(q, k_ctx, cu_seqlens_cpu),
                                              deterministic, window, causal)
