"""Triton kernels of the frozen head's statistics: one read of a chunk of raw logits (compute dtype) gives,
per row and in fp32, the log-sum-exp of the mapped logits z = softcap tanh(scale raw / softcap), the gold
logit, the argmax and the top-K values and ids; the backward writes the cross-entropy's gradient with
respect to the raw logits into the same buffer, in place.

The map is increasing, so the argmax and the top-K are selected on the raw values (exact: ties keep the
lower id, as torch.argmax does) and only the K winners are mapped. A row is cut into vocabulary splits
(grid rows x splits) so that few rows still fill a GPU; each split keeps its maximum, its sum of
exponentials, its argmax and its K best in registers (a candidate list refreshed only from a tile's
values above the list's current minimum: after the first tiles almost none), and a second kernel merges
the splits of a row. The split count depends on the sizes only, so results never depend on timings.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.backend import is_interpreting
from ..common.triton_utils import autotune, launch

SPLIT_STEP = 128 if is_interpreting() else 4096  # vocabulary per split: whole steps (a multiple of every tile)
MIN_PROGRAMS = 2048  # rows x splits at least this, where the vocabulary allows
MAX_SPLITS = 64
_TILES = [64] if is_interpreting() else [512, 1024]
_GRAD_TILES = [128] if is_interpreting() else [1024, 2048]
FALLBACK = 'the torch reference (head_topk(..., backend="torch"))'


@triton.jit
def _map(raw, logit_scale, softcap_scale, SOFTCAP: tl.constexpr):
    # softcap tanh(scale raw / softcap), tanh by exp2 (saturates cleanly at +-1)
    z = raw * logit_scale
    if SOFTCAP:
        z = softcap_scale * (1.0 - 2.0 / (tl.math.exp2(z * (2.0 * 1.4426950408889634) / softcap_scale) + 1.0))
    return z


@autotune({"BLOCK_V": _TILES, "num_warps": [1, 2], "num_stages": [2]}, ["K", "SOFTCAP"], FALLBACK)
@triton.jit(do_not_specialize=["n_vocab", "n_split", "n_splits"])
def _stats_kernel(LOGITS, PART_M, PART_S, part_arg, PART_V, part_id, n_vocab, n_split, n_splits, logit_scale,
                  softcap_scale, SOFTCAP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK_V: tl.constexpr):
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    base = LOGITS + row * n_vocab
    lo = split * n_split
    hi = tl.minimum(lo + n_split, n_vocab)
    lanes = tl.arange(0, BLOCK_V)
    slots = tl.arange(0, KP)
    m_raw = float("-inf")  # the split's largest raw logit, and its first id
    arg = lo
    m_z = float("-inf")  # running maximum of the mapped logits, and the sum of exp(z - m_z)
    s = 0.0
    top_v = tl.where(slots < K, float("-inf"), float("inf"))  # padding slots are never the weakest
    top_i = tl.where(slots < K, -1, 2147483647)
    for v0 in range(lo, hi, BLOCK_V):
        ids = v0 + lanes
        ok = ids < hi
        raw = tl.load(base + ids, mask=ok, other=float("-inf")).to(tl.float32)  # (BLOCK_V,)
        t_max = tl.max(raw, 0)
        t_arg = tl.argmax(raw, 0, tie_break_left=True)
        arg = tl.where(t_max > m_raw, v0 + t_arg, arg)
        m_raw = tl.maximum(m_raw, t_max)
        z = _map(raw, logit_scale, softcap_scale, SOFTCAP)
        m_new = tl.maximum(m_z, tl.max(z, 0))
        s = s * tl.math.exp2((m_z - m_new) * 1.4426950408889634) + tl.sum(
            tl.where(ok, tl.math.exp2((z - m_new) * 1.4426950408889634), 0.0), 0)  # (a masked id maps to -cap)
        m_z = m_new
        if K > 0:
            threshold = tl.min(top_v, 0)
            live = ok & (raw > threshold)  # strictly above: a later id never displaces an equal value
            n = tl.sum(live.to(tl.int32), 0)
            while n > 0:
                best = tl.max(tl.where(live, raw, float("-inf")), 0)
                at = tl.argmax(tl.where(live, raw, float("-inf")), 0, tie_break_left=True)
                # the weakest member: the smallest value, among equals the highest id
                weakest = tl.argmax(tl.where(top_v == threshold, top_i, -2), 0, tie_break_left=True)
                top_v = tl.where(slots == weakest, best, top_v)
                top_i = tl.where(slots == weakest, v0 + at, top_i)
                threshold = tl.min(top_v, 0)
                live = live & (lanes != at) & (raw > threshold)
                n = tl.sum(live.to(tl.int32), 0)
    at = row * n_splits + split
    tl.store(PART_M + at, m_raw)
    tl.store(PART_S + at, s * tl.math.exp2((m_z - _map(m_raw, logit_scale, softcap_scale, SOFTCAP))
                                           * 1.4426950408889634))  # scaled to the split's mapped maximum
    tl.store(part_arg + at, arg)
    if K > 0:
        tl.store(PART_V + at * KP + slots, top_v)
        tl.store(part_id + at * KP + slots, top_i)


@autotune({"num_warps": [1, 4], "num_stages": [1]}, ["K", "SOFTCAP", "BLOCK_S"], FALLBACK)
@triton.jit(do_not_specialize=["n_vocab", "n_splits"])
def _combine_kernel(LOGITS, labels, PART_M, PART_S, part_arg, PART_V, part_id, LSE, GOLD, argmax, TOP_V, top_id,
                    n_vocab, n_splits, logit_scale, softcap_scale, SOFTCAP: tl.constexpr, K: tl.constexpr,
                    KP: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    ok = splits < n_splits
    m = tl.load(PART_M + row * n_splits + splits, mask=ok, other=float("-inf"))
    s = tl.load(PART_S + row * n_splits + splits, mask=ok, other=0.0)
    args = tl.load(part_arg + row * n_splits + splits, mask=ok, other=0)
    m_raw = tl.max(m, 0)
    zs = _map(m, logit_scale, softcap_scale, SOFTCAP)
    z_max = _map(m_raw, logit_scale, softcap_scale, SOFTCAP)
    total = tl.sum(tl.where(ok, s * tl.math.exp2((zs - z_max) * 1.4426950408889634), 0.0), 0)
    tl.store(LSE + row, z_max + tl.log(total))
    first = tl.argmax(tl.where(ok & (m == m_raw), -splits, -BLOCK_S), 0, tie_break_left=True)  # lowest split
    tl.store(argmax + row, tl.sum(tl.where(splits == first, args, 0), 0))
    label = tl.load(labels + row)
    gold = tl.load(LOGITS + row * n_vocab + label).to(tl.float32)
    tl.store(GOLD + row, _map(gold, logit_scale, softcap_scale, SOFTCAP))
    if K > 0:
        c = tl.arange(0, BLOCK_S * KP)  # every split's candidates
        c_ok = (c // KP < n_splits) & (c % KP < K)
        vals = tl.load(PART_V + row * n_splits * KP + c, mask=c_ok, other=float("-inf"))
        ids = tl.load(part_id + row * n_splits * KP + c, mask=c_ok, other=2147483647)
        vals = tl.where(ids < 0, float("-inf"), vals)
        for k in tl.static_range(K):
            best = tl.max(vals, 0)
            best_id = tl.min(tl.where(vals == best, ids, 2147483647), 0)  # among equals the lowest id
            tl.store(TOP_V + row * K + k, _map(best, logit_scale, softcap_scale, SOFTCAP))
            tl.store(top_id + row * K + k, best_id)
            vals = tl.where(ids == best_id, float("-inf"), vals)
            ids = tl.where(ids == best_id, 2147483647, ids)


# In place: the autotuner runs configs on the live buffer, so LOGITS is restored after each timed run.
@autotune({"BLOCK_V": _GRAD_TILES, "num_warps": [4, 8], "num_stages": [1]}, ["SOFTCAP"], FALLBACK,
          restore_value=["LOGITS"])
@triton.jit(do_not_specialize=["n_vocab"])
def _grad_kernel(LOGITS, labels, LSE, COEF, n_vocab, logit_scale, softcap_scale, SOFTCAP: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    # logits[r, v] <- coef[r] (exp(z - lse) - [v = label]) dz/draw
    row = tl.program_id(0).to(tl.int64)
    ids = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = ids < n_vocab
    ptr = LOGITS + row * n_vocab + ids
    z = _map(tl.load(ptr, mask=ok, other=0.0).to(tl.float32), logit_scale, softcap_scale, SOFTCAP)
    lse = tl.load(LSE + row)
    coef = tl.load(COEF + row)
    label = tl.load(labels + row)
    g = coef * (tl.math.exp2((z - lse) * 1.4426950408889634) - tl.where(ids == label, 1.0, 0.0))
    if SOFTCAP:
        t = z / softcap_scale
        g = g * ((1.0 - t * t) * logit_scale)
    else:
        g = g * logit_scale
    tl.store(ptr, g.to(LOGITS.dtype.element_ty), mask=ok)


def splits(rows: int, vocab: int) -> tuple[int, int]:
    """(splits per row, vocabulary per split): enough programs for a GPU, whole SPLIT_STEPs each."""
    want = min(MAX_SPLITS, max(1, triton.cdiv(MIN_PROGRAMS, max(rows, 1))))
    per = max(SPLIT_STEP, triton.cdiv(triton.cdiv(vocab, want), SPLIT_STEP) * SPLIT_STEP)
    return triton.cdiv(vocab, per), per


def _softcap(softcap):
    return (True, float(softcap)) if softcap is not None else (False, 1.0)


def head_topk_triton(logits, labels, top_k, logit_scale, softcap, pinned=False):
    rows, vocab = logits.shape
    n_splits, per = splits(rows, vocab)
    kp = triton.next_power_of_2(max(top_k, 1))
    dev, f32 = logits.device, torch.float32
    part_m = torch.empty(rows, n_splits, dtype=f32, device=dev)
    part_s = torch.empty_like(part_m)
    part_arg = torch.empty(rows, n_splits, dtype=torch.int32, device=dev)
    part_v = torch.empty(rows, n_splits, kp, dtype=f32, device=dev)
    part_id = torch.empty(rows, n_splits, kp, dtype=torch.int32, device=dev)
    has_cap, cap = _softcap(softcap)
    flags = dict(SOFTCAP=has_cap, K=top_k, KP=kp)
    launch(_stats_kernel, (rows, n_splits), (logits, part_m, part_s, part_arg, part_v, part_id, vocab, per,
                                             n_splits, logit_scale, cap), flags, pinned)
    lse, gold = torch.empty(rows, dtype=f32, device=dev), torch.empty(rows, dtype=f32, device=dev)
    argmax = torch.empty(rows, dtype=torch.int32, device=dev)
    top_v = torch.empty(rows, top_k, dtype=f32, device=dev)
    top_id = torch.empty(rows, top_k, dtype=torch.int32, device=dev)
    launch(_combine_kernel, (rows,), (logits, labels.to(torch.int32), part_m, part_s, part_arg, part_v, part_id,
                                      lse, gold, argmax, top_v, top_id, vocab, n_splits, logit_scale, cap),
           {**flags, "BLOCK_S": triton.next_power_of_2(n_splits)}, pinned)
    return lse, gold, argmax.long(), top_v, top_id.long()


def head_topk_backward_triton_(logits, labels, lse, coef, logit_scale, softcap, pinned=False):
    rows, vocab = logits.shape
    has_cap, cap = _softcap(softcap)
    launch(_grad_kernel, lambda meta: (rows, triton.cdiv(vocab, meta["BLOCK_V"])),
           (logits, labels.to(torch.int32), lse, coef, vocab, logit_scale, cap), dict(SOFTCAP=has_cap), pinned)
    return logits


def compile_cases(top_k: int = 16, softcap: bool = True) -> list:
    """(autotuned kernel, constexprs) as the op launches them (8 splits: a typical chunk's)."""
    kp = triton.next_power_of_2(max(top_k, 1))
    flags = dict(SOFTCAP=softcap, K=top_k, KP=kp)
    return [(_stats_kernel, flags), (_combine_kernel, {**flags, "BLOCK_S": 8}), (_grad_kernel, {"SOFTCAP": softcap})]
