"""Triton kernels for packed varlen attention: forward, and the FA2 backward: dK/dV with dQ
accumulated by atomics (5 GEMMs per tile pair), or deterministic, dQ in a second kernel (7).

Layout: q/o (T, HQ, D), k/v (T, HKV, D), contiguous; lse and delta (HQ, T) fp32 (n_rows = T),
so that a tile's rows load contiguously; lse is in base 2 (scores are pre-multiplied by
scale * log2(e) so the kernels use exp2).
Grids are flat: program = tile_list_entry * heads + head, tile lists from common.tiles.
No sequence length is a kernel argument (they are read from cu_seqlens), so nothing
recompiles when lengths or sample counts change; the autotune key is the head
dim, head counts, size class (size_bucket) and every variant flag (CAUSAL, OFFS64, FUSED_DQ;
Triton adds the dtypes). Deterministic mode runs pinned configs (common.triton_utils.launch).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...errors import UserError
from ..common.backend import is_interpreting
from ..common.compile_check import current_capability, fitting_configs
from ..common.delta import attention_delta
from ..common.tiles import TILE_CACHE, longest_sample, sequence_tiles
from ..common.triton_utils import (
    LOG2E,
    autotune,
    check_triton_inputs,
    launch,
    offsets_need_int64,
    size_bucket,
    tile_rows,
)

# Tile sizes that shape the tile lists are fixed per kernel (the list is built before the
# launch); only the inner loop's step is autotuned. The interpreter uses small tiles so that
# tests with short samples still cross tile boundaries.
# Before tile_rows (halved for rows over 256 bytes).
FWD_BLOCK_M = 32 if is_interpreting() else 128
DKV_BLOCK_N = 32 if is_interpreting() else 128
DKV_ROW_BYTES = 128  # halve DKV_BLOCK_N per doubling above this: its dK/dV accumulators spill at 128 rows
DQ_BLOCK_M = 32 if is_interpreting() else 128
_INNER = [16] if is_interpreting() else [32, 64]
# 16-row query steps: the atomic dK/dV kernel's only non-spilling configs under Triton 3.6 (head dim 128, bf16)
_DKV_INNER = [16] if is_interpreting() else [16, 32, 64]
_FWD_INNER = [16] if is_interpreting() else [64, 128]
# n_bucket: size_bucket(rows), tuned per size class; every variant flag is in the key, so that one
# variant's tuning never picks the config of another (which may spill or not fit).
_KEY = ["HQ", "HKV", "D", "CAUSAL", "OFFS64", "n_bucket"]
# Hopper and datacenter Blackwell (wgmma, tcgen05) read dot operands from shared memory; sm_80 and
# sm_120a (mma.sync) hold them in registers, where a 128-row query tile of 256-byte rows (head
# dim 128 in bf16) spills in every config: the query tiles get half the rows there.
_SMEM_OPERAND_ARCHS = (90, 100)


def _query_rows(full: int, head_dim: int, dtype: torch.dtype, cap: int) -> int:
    return tile_rows(full, head_dim, dtype, 256 if cap in _SMEM_OPERAND_ARCHS else 128)


def _capability(x: torch.Tensor) -> int:
    return current_capability() if x.is_cuda else _SMEM_OPERAND_ARCHS[0]  # (the interpreter's tiles are fixed)
VARLEN_FALLBACK = 'backend="torch_varlen" (or "flash_attn" where installed, or the reference "torch")'


@autotune({"BLOCK_N": _FWD_INNER, "num_warps": [4, 8], "num_stages": [2, 3]}, _KEY + ["SLIDING"], VARLEN_FALLBACK)
@triton.jit(do_not_specialize=["n_window", "n_bucket", "n_rows"])
def _fwd_kernel(Q, K, V, OUT, LSE, cu_seqlens, tiles, qk_scale, n_window, n_bucket, n_rows,
                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OFFS64: tl.constexpr):
    # SLIDING (causal only): row i sees keys i - n_window < j <= i; key tiles before the first row's
    # window are skipped and every tile after is masked (a window spans few tiles).
    pid = tl.program_id(0)
    i_tile, i_h = pid // HQ, pid % HQ
    seq = tl.load(tiles + 2 * i_tile)
    if seq < 0:  # sentinel past the real tiles
        return
    i_kh = i_h // (HQ // HKV)
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    L = tl.load(cu_seqlens + seq + 1) - bos.to(tl.int32)
    m0 = tl.load(tiles + 2 * i_tile + 1) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)  # positions inside the sample
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    if OFFS64:  # a sample of 2**31 elements or more (offsets_need_int64)
        rows, offs_n = rows.to(tl.int64), offs_n.to(tl.int64)
    row_ok = rows < L
    # Per-sample int64 scalar bases, int32 tile offsets: int64 offset tensors cost registers (spills).
    q_base = Q + bos * (HQ * D) + i_h * D
    q = tl.load(q_base + (rows[:, None] * (HQ * D) + offs_d[None, :]), mask=row_ok[:, None], other=0.0)
    k_base = K + bos * (HKV * D) + i_kh * D
    v_base = V + bos * (HKV * D) + i_kh * D

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    lo = 0
    if CAUSAL:
        full_end = (m0 // BLOCK_N) * BLOCK_N  # key tiles ending before the first row
        hi = tl.minimum(m0 + BLOCK_M, L)
        if SLIDING:
            lo = (tl.maximum(m0 - n_window + 1, 0) // BLOCK_N) * BLOCK_N
            full_end = lo
    else:
        full_end = (L // BLOCK_N) * BLOCK_N
        hi = L
    # Fully visible key tiles: no bounds, no mask.
    for n0 in range(lo, full_end, BLOCK_N):
        kT = tl.load(k_base + (n0 + offs_n)[None, :] * (HKV * D) + offs_d[:, None])  # (D, BLOCK_N)
        v = tl.load(v_base + (n0 + offs_n)[:, None] * (HKV * D) + offs_d[None, :])
        s = tl.dot(q, kT)  # scaled inside exp2 below: one FMA per score
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # The diagonal (causal) or the ragged end (non-causal).
    for n0 in range(full_end, hi, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < L
        kT = tl.load(k_base + cols[None, :] * (HKV * D) + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * (HKV * D) + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, kT)  # scaled inside exp2 below: one FMA per score
        visible = col_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        if SLIDING:
            visible = visible & (rows[:, None] - cols[None, :] < n_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past the end see nothing
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s * qk_scale - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    o = acc / l_i[:, None]
    o_base = OUT + bos * (HQ * D) + i_h * D
    tl.store(o_base + (rows[:, None] * (HQ * D) + offs_d[None, :]), o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + i_h * n_rows + bos + rows, m_i + tl.math.log2(l_i), mask=row_ok)


# dQ is accumulated into DQ_ACC: the autotuner must zero it after timing the configs on the live buffers.
@autotune({"BLOCK_M": _DKV_INNER, "num_warps": [4, 8], "num_stages": [1, 2, 3]}, _KEY + ["FUSED_DQ"], VARLEN_FALLBACK,
          reset_to_zero=["DQ_ACC"])
@triton.jit(do_not_specialize=["n_bucket", "n_rows"])
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, cu_seqlens, tiles, qk_scale, sm_scale, n_bucket, n_rows,
                     HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FUSED_DQ: tl.constexpr, OFFS64: tl.constexpr):
    # One program: BLOCK_N keys of one kv head; loops over the HQ // HKV query heads that read
    # them (GQA summed here, no atomics) and over the query tiles that see them. With FUSED_DQ
    # each query tile's dQ from these keys is added to DQ_ACC (fp32, unscaled) with atomics:
    # 5 GEMMs per tile pair instead of 4 here and 3 in _bwd_dq_kernel, but the order of the
    # additions, hence the last bits of dQ, varies from run to run.
    pid = tl.program_id(0)
    i_tile, i_kh = pid // HKV, pid % HKV
    seq = tl.load(tiles + 2 * i_tile)
    if seq < 0:
        return
    G: tl.constexpr = HQ // HKV
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    L = tl.load(cu_seqlens + seq + 1) - bos.to(tl.int32)
    n0 = tl.load(tiles + 2 * i_tile + 1) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_m = tl.arange(0, BLOCK_M)
    if OFFS64:
        cols, offs_m = cols.to(tl.int64), offs_m.to(tl.int64)
    col_ok = cols < L
    kv_base = bos * (HKV * D) + i_kh * D  # int64 scalar; the tile offsets stay int32 (fewer registers)
    kv_off = cols[:, None] * (HKV * D) + offs_d[None, :]
    k = tl.load(K + kv_base + kv_off, mask=col_ok[:, None], other=0.0)  # (BLOCK_N, D)
    v = tl.load(V + kv_base + kv_off, mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    # Query rows past L load as zeros (q, dO, lse, delta) and so add exactly nothing: only the
    # causal diagonal needs a mask.
    if CAUSAL:
        lo = n0
        # where the masked loop below stops: past the key tile when BLOCK_M > BLOCK_N
        diag_end = n0 + tl.cdiv(tl.minimum(BLOCK_N, L - n0), BLOCK_M) * BLOCK_M
    else:
        lo = 0
        diag_end = 0
    for g in range(G):
        i_h = i_kh * G + g
        q_base = bos * (HQ * D) + i_h * D
        for m0 in range(lo, diag_end, BLOCK_M):
            rows = m0 + offs_m
            row_ok = rows < L
            q_off = rows[:, None] * (HQ * D) + offs_d[None, :]
            q = tl.load(Q + q_base + q_off, mask=row_ok[:, None], other=0.0)
            do = tl.load(DO + q_base + q_off, mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + i_h * n_rows + bos + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + i_h * n_rows + bos + rows, mask=row_ok, other=0.0)
            pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])  # (BLOCK_N, BLOCK_M)
            pT = tl.where(cols[:, None] <= rows[None, :], pT, 0.0)
            dv += tl.dot(pT.to(do.dtype), do)
            dsT = pT * (tl.dot(v, tl.trans(do)) - delta[None, :])
            dk += tl.dot(dsT.to(q.dtype), q)
            if FUSED_DQ:
                tl.atomic_add(DQ_ACC + q_base + q_off, tl.dot(tl.trans(dsT.to(k.dtype)), k), mask=row_ok[:, None],
                              sem="relaxed")
        for m0 in range(diag_end, L, BLOCK_M):
            rows = m0 + offs_m
            row_ok = rows < L
            q_off = rows[:, None] * (HQ * D) + offs_d[None, :]
            q = tl.load(Q + q_base + q_off, mask=row_ok[:, None], other=0.0)
            do = tl.load(DO + q_base + q_off, mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + i_h * n_rows + bos + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + i_h * n_rows + bos + rows, mask=row_ok, other=0.0)
            pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
            if FUSED_DQ and not CAUSAL:
                # keys past L load as zeros but their p does not vanish: unmasked, ds could overflow
                # (float16) and inf * 0 would put NaN into dQ
                pT = tl.where(col_ok[:, None], pT, 0.0)
            dv += tl.dot(pT.to(do.dtype), do)
            dsT = pT * (tl.dot(v, tl.trans(do)) - delta[None, :])
            dk += tl.dot(dsT.to(q.dtype), q)
            if FUSED_DQ:
                tl.atomic_add(DQ_ACC + q_base + q_off, tl.dot(tl.trans(dsT.to(k.dtype)), k), mask=row_ok[:, None],
                              sem="relaxed")
    tl.store(DK + kv_base + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + kv_base + kv_off, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@autotune({"BLOCK_N": _INNER, "num_warps": [4, 8], "num_stages": [1, 2, 3]}, _KEY, VARLEN_FALLBACK)
@triton.jit(do_not_specialize=["n_bucket", "n_rows"])
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, cu_seqlens, tiles, qk_scale, sm_scale, n_bucket, n_rows,
                   HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OFFS64: tl.constexpr):
    pid = tl.program_id(0)
    i_tile, i_h = pid // HQ, pid % HQ
    seq = tl.load(tiles + 2 * i_tile)
    if seq < 0:
        return
    i_kh = i_h // (HQ // HKV)
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    L = tl.load(cu_seqlens + seq + 1) - bos.to(tl.int32)
    m0 = tl.load(tiles + 2 * i_tile + 1) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    if OFFS64:
        rows, offs_n = rows.to(tl.int64), offs_n.to(tl.int64)
    row_ok = rows < L
    q_base = bos * (HQ * D) + i_h * D  # int64 scalar; the tile offsets stay int32 (fewer registers)
    q_off = rows[:, None] * (HQ * D) + offs_d[None, :]
    q = tl.load(Q + q_base + q_off, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + q_base + q_off, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + i_h * n_rows + bos + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + i_h * n_rows + bos + rows, mask=row_ok, other=0.0)
    k_base = K + bos * (HKV * D) + i_kh * D
    v_base = V + bos * (HKV * D) + i_kh * D
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    # The causal diagonal and the non-causal ragged end are masked: a key past L loads as zero,
    # but its p = exp2(-lse) is not (large when the row's lse is very negative, enough to make
    # ds overflow in float16 and dQ NaN).
    if CAUSAL:
        full_end = (m0 // BLOCK_N) * BLOCK_N
        hi = tl.minimum(m0 + BLOCK_M, L)
    else:
        full_end = (L // BLOCK_N) * BLOCK_N
        hi = L
    for n0 in range(0, full_end, BLOCK_N):
        cols = n0 + offs_n
        kT = tl.load(k_base + cols[None, :] * (HKV * D) + offs_d[:, None])
        vT = tl.load(v_base + cols[None, :] * (HKV * D) + offs_d[:, None])
        p = tl.math.exp2(tl.dot(q, kT) * qk_scale - lse[:, None])
        ds = p * (tl.dot(do, vT) - delta[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))
    for n0 in range(full_end, hi, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < L
        kT = tl.load(k_base + cols[None, :] * (HKV * D) + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        vT = tl.load(v_base + cols[None, :] * (HKV * D) + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        p = tl.math.exp2(tl.dot(q, kT) * qk_scale - lse[:, None])
        visible = col_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        p = tl.where(visible, p, 0.0)
        ds = p * (tl.dot(do, vT) - delta[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))
    tl.store(DQ + q_base + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def compile_cases(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype, cap: int) -> list:
    """(autotuned kernel, constexprs) of every kernel as the launchers below call it on capability `cap`."""
    cases = []
    for causal in (True, False):
        common = dict(HQ=heads, HKV=kv_heads, D=head_dim, CAUSAL=causal, OFFS64=False)
        dkdv = {**common, "BLOCK_N": tile_rows(DKV_BLOCK_N, head_dim, dtype, DKV_ROW_BYTES)}
        fwd = {**common, "SLIDING": False, "BLOCK_M": _query_rows(FWD_BLOCK_M, head_dim, dtype, cap)}
        cases += [(_fwd_kernel, fwd),
                  (_bwd_dkdv_kernel, {**dkdv, "FUSED_DQ": True}), (_bwd_dkdv_kernel, {**dkdv, "FUSED_DQ": False}),
                  (_bwd_dq_kernel, {**common, "BLOCK_M": _query_rows(DQ_BLOCK_M, head_dim, dtype, cap)})]
    return cases


@functools.cache
def unservable(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype, causal: bool, deterministic: bool,
               cap: int) -> str | None:
    """Why the kernels that such a call launches cannot run on capability `cap` (no config fits in
    shared memory), or None. Compiles what the autotuner would compile at the launch anyway."""
    for tuner, constexprs in compile_cases(head_dim, heads, kv_heads, dtype, cap):
        if constexprs["CAUSAL"] != causal or constexprs.get("FUSED_DQ", not deterministic) == deterministic:
            continue
        if tuner is _bwd_dq_kernel and not deterministic:
            continue
        try:
            fitting_configs(tuner, dtype, constexprs, cap)
        except UserError as err:
            return str(err)
    return None


def _tiles(cu_seqlens, block, total, causal, cu_seqlens_cpu):
    return TILE_CACHE.get((cu_seqlens,), ("varlen", block, total, causal),
                          lambda: sequence_tiles(cu_seqlens, block, total, causal, cu_seqlens_cpu))


def _offs64(q, cu_seqlens_cpu) -> bool:
    longest = q.shape[0] if cu_seqlens_cpu is None else longest_sample(cu_seqlens_cpu)
    return offsets_need_int64(longest, q.shape[1], q.shape[2])


def varlen_fwd(q, k, v, cu_seqlens, causal, scale, cu_seqlens_cpu, deterministic=False, window=None):
    """Output and base-2 lse; `window` (causal only): each row sees its `window` latest keys."""
    T, HQ, D = q.shape
    HKV = k.shape[1]
    block_m = _query_rows(FWD_BLOCK_M, D, q.dtype, _capability(q))
    tiles = _tiles(cu_seqlens, block_m, T, causal, cu_seqlens_cpu)
    o = torch.empty_like(q)
    lse = torch.empty((HQ, T), dtype=torch.float32, device=q.device)
    launch(_fwd_kernel, (tiles.shape[0] * HQ,),
           (q, k, v, o, lse, cu_seqlens, tiles, scale * LOG2E, window or 0, size_bucket(T), T),
           dict(HQ=HQ, HKV=HKV, D=D, CAUSAL=causal, SLIDING=window is not None, BLOCK_M=block_m,
                OFFS64=_offs64(q, cu_seqlens_cpu)), pinned=deterministic)
    return o, lse


def varlen_bwd(do, q, k, v, o, lse, cu_seqlens, causal, scale, cu_seqlens_cpu, deterministic):
    T, HQ, D = q.shape
    HKV = k.shape[1]
    delta = attention_delta(do, o, pinned=deterministic)  # rowsum(dO * O), (HQ, rows) fp32
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    # Without determinism dQ is accumulated (fp32, unscaled) by the dK/dV kernel's atomics
    # (deterministic: an empty tensor the kernel never touches, so the signature stays the same).
    dq_acc = torch.zeros((0,) if deterministic else q.shape, dtype=torch.float32, device=q.device)
    block_n = tile_rows(DKV_BLOCK_N, D, q.dtype, DKV_ROW_BYTES)
    kv_tiles = _tiles(cu_seqlens, block_n, T, False, cu_seqlens_cpu)
    consts = dict(HQ=HQ, HKV=HKV, D=D, CAUSAL=causal, OFFS64=_offs64(q, cu_seqlens_cpu))
    launch(_bwd_dkdv_kernel, (kv_tiles.shape[0] * HKV,),
           (q, k, v, do, lse, delta, dk, dv, dq_acc, cu_seqlens, kv_tiles, scale * LOG2E, scale, size_bucket(T), T),
           dict(consts, BLOCK_N=block_n, FUSED_DQ=not deterministic), pinned=deterministic)
    if not deterministic:
        return dq_acc.mul_(scale).to(q.dtype), dk, dv
    dq = torch.empty_like(q)
    block_m = _query_rows(DQ_BLOCK_M, D, q.dtype, _capability(q))
    q_tiles = _tiles(cu_seqlens, block_m, T, causal, cu_seqlens_cpu)
    launch(_bwd_dq_kernel, (q_tiles.shape[0] * HQ,),
           (q, k, v, do, lse, delta, dq, cu_seqlens, q_tiles, scale * LOG2E, scale, size_bucket(T), T),
           dict(consts, BLOCK_M=block_m), pinned=True)
    return dq, dk, dv


class VarlenAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, causal, scale, cu_seqlens_cpu, deterministic):
        o, lse = varlen_fwd(q, k, v, cu_seqlens, causal, scale, cu_seqlens_cpu, deterministic)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.args = (causal, scale, cu_seqlens_cpu, deterministic)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = varlen_bwd(do.contiguous(), q, k, v, o, lse, cu_seqlens, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def varlen_attention_triton(q, k, v, cu_seqlens, causal, scale, cu_seqlens_cpu=None, deterministic=False):
    check_triton_inputs(q)
    return VarlenAttentionFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens.contiguous(),
                                         causal, scale, cu_seqlens_cpu, deterministic)
