"""Triton kernels of the DFlash2 block convolution: a forward, and one backward kernel that gives
dx, d dynamic and the base kernel's gradient from the op's inputs alone (nothing of the forward is
kept: x, the dynamic weights and the base kernel are all the op saves).

Layout: x, out, dx (N, H) contiguous, N = blocks x B rows, block-major; dynamic (N, K, H/G) with
its last two dims contiguous and any row stride (it is a slice of the kernel projection's output);
base (K, H) in x's dtype. Row r is slot r % B of its block; tap i of row r reads row r - i when
slot >= i, so a tile of rows may span blocks and B need not be a power of two.

The base gradient is a sum over every row: the backward's grid is (row split, channel tile), each
program walks its split's rows and stores its partial sum (DBASE_PART, fp32), summed afterwards
by torch in a fixed order. Nothing is accumulated across programs (no atomics, no reset_to_zero
needed: a config the autotuner runs several times on the live buffers rewrites the same values),
and the result does not depend on timings.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.backend import is_interpreting
from ..common.triton_utils import autotune, launch, size_bucket

# Channels per tile: a whole number of groups (the d dynamic reduction is per group).
MIN_CHANNELS = 64
# Rows of one backward split, a multiple of every tuned BLOCK_R; the split count is then fixed by
# the row count alone, so is the order of the base gradient's sum.
SPLIT_STEP = 32 if is_interpreting() else 256
SPLITS = 64  # about as many splits as a GPU's SMs take programs per channel tile
_ROWS = [16] if is_interpreting() else [32, 64]
_KEY = ["H", "G", "K", "B", "n_bucket"]
FALLBACK = 'backend="torch" (the recomputing reference)'


@autotune({"BLOCK_R": _ROWS, "num_warps": [4], "num_stages": [1, 2]}, _KEY, FALLBACK)
@triton.jit(do_not_specialize=["n_rows", "n_dyn_stride", "n_bucket"])
def _fwd_kernel(X, DYN, BASE, OUT, n_rows, n_dyn_stride, n_bucket, H: tl.constexpr, G: tl.constexpr,
                K: tl.constexpr, B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    row_ok, col_ok = rows < n_rows, cols < H
    slot = rows % B
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for i in tl.static_range(K):
        ok = (row_ok & (slot >= i))[:, None] & col_ok[None, :]
        x = tl.load(X + (rows64 - i)[:, None] * H + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        w = tl.load(BASE + i * H + cols, mask=col_ok, other=0.0).to(tl.float32)
        d = tl.load(DYN + rows64[:, None] * n_dyn_stride + (i * (H // G) + cols // G)[None, :], mask=ok,
                    other=0.0).to(tl.float32)
        acc += (w[None, :] + d) * x
    tl.store(OUT + rows64[:, None] * H + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@autotune({"BLOCK_R": _ROWS, "num_warps": [4], "num_stages": [1, 2]}, _KEY, FALLBACK)
@triton.jit(do_not_specialize=["n_rows", "n_dyn_stride", "n_split_rows", "n_bucket"])
def _bwd_kernel(X, DYN, BASE, DO, DX, DDYN, DBASE_PART, n_rows, n_dyn_stride, n_split_rows, n_bucket,
                H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, B: tl.constexpr, KP: tl.constexpr,
                BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    # dx[s] = sum_i do[s + i] (base[i] + dyn[s + i, i])   (slot(s) + i < B)
    # ddyn[t, i, g] = sum_{c in g} do[t, c] x[t - i, c]   (slot(t) >= i), dbase[i] = the same summed over rows
    split, tile = tl.program_id(0), tl.program_id(1)
    cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    gcols = tile * (BLOCK_C // G) + tl.arange(0, BLOCK_C // G)  # this tile's groups
    col_ok, gcol_ok = cols < H, gcols < H // G
    taps = tl.arange(0, KP)  # (KP,): K rounded up to a power of two
    dbase = tl.zeros([KP, BLOCK_C], tl.float32)
    lo = split * n_split_rows
    hi = tl.minimum(lo + n_split_rows, n_rows)
    for r0 in range(lo, hi, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < hi
        slot = rows % B
        rows64 = rows.to(tl.int64)
        here = row_ok[:, None] & col_ok[None, :]
        do = tl.load(DO + rows64[:, None] * H + cols[None, :], mask=here, other=0.0).to(tl.float32)
        dx = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
        for i in tl.static_range(K):
            ahead = (row_ok & (slot + i < B))[:, None] & col_ok[None, :]  # row s + i is in s's block
            do_i = tl.load(DO + (rows64 + i)[:, None] * H + cols[None, :], mask=ahead, other=0.0).to(tl.float32)
            d_i = tl.load(DYN + (rows64 + i)[:, None] * n_dyn_stride + (i * (H // G) + cols // G)[None, :],
                          mask=ahead, other=0.0).to(tl.float32)
            w = tl.load(BASE + i * H + cols, mask=col_ok, other=0.0).to(tl.float32)
            dx += do_i * (w[None, :] + d_i)
            behind = (row_ok & (slot >= i))[:, None] & col_ok[None, :]  # row t - i is in t's block
            x = tl.load(X + (rows64 - i)[:, None] * H + cols[None, :], mask=behind, other=0.0).to(tl.float32)
            prod = do * x  # (BLOCK_R, BLOCK_C), zero where masked
            ddyn = tl.sum(tl.reshape(prod, (BLOCK_R, BLOCK_C // G, G)), axis=2)  # (BLOCK_R, BLOCK_C // G)
            tl.store(DDYN + rows64[:, None] * (K * (H // G)) + (i * (H // G) + gcols)[None, :],
                     ddyn.to(DDYN.dtype.element_ty), mask=row_ok[:, None] & gcol_ok[None, :])
            dbase += tl.where(taps[:, None] == i, tl.sum(prod, axis=0)[None, :], 0.0)
        tl.store(DX + rows64[:, None] * H + cols[None, :], dx.to(DX.dtype.element_ty), mask=here)
    tl.store(DBASE_PART + (split * KP + taps)[:, None] * H + cols[None, :], dbase,
             mask=(taps < K)[:, None] & col_ok[None, :])


def _constexprs(hidden: int, group: int, taps: int, block_size: int) -> dict:
    return dict(H=hidden, G=group, K=taps, B=block_size, BLOCK_C=max(MIN_CHANNELS, group))


def splits(rows: int) -> tuple[int, int]:
    """(splits, rows per split) of the backward: at most SPLITS, whole SPLIT_STEPs each."""
    per = max(SPLIT_STEP, triton.cdiv(triton.cdiv(rows, SPLITS), SPLIT_STEP) * SPLIT_STEP)
    return triton.cdiv(rows, per), per


def conv_forward(x, dynamic, base, block_size, group_size, pinned=False):
    rows, hidden = x.shape
    out = torch.empty_like(x)
    c = _constexprs(hidden, group_size, base.shape[0], block_size)
    launch(_fwd_kernel, lambda meta: (triton.cdiv(rows, meta["BLOCK_R"]), triton.cdiv(hidden, c["BLOCK_C"])),
           (x, dynamic, base, out, rows, dynamic.stride(0), size_bucket(rows)), c, pinned)
    return out


def conv_backward(do, x, dynamic, base, block_size, group_size, pinned=False):
    """-> (dx (N, H), ddynamic (N, K, H/G)) in x's dtype, dbase (K, H) fp32."""
    rows, hidden = x.shape
    taps = base.shape[0]
    n_splits, per = splits(rows)
    c = _constexprs(hidden, group_size, taps, block_size)
    kp = triton.next_power_of_2(taps)
    dx = torch.empty_like(x)
    ddyn = torch.empty(rows, taps, hidden // group_size, dtype=x.dtype, device=x.device)
    part = torch.empty(n_splits, kp, hidden, dtype=torch.float32, device=x.device)
    launch(_bwd_kernel, (n_splits, triton.cdiv(hidden, c["BLOCK_C"])),
           (x, dynamic, base, do, dx, ddyn, part, rows, dynamic.stride(0), per, size_bucket(rows)), {**c, "KP": kp},
           pinned)
    return dx, ddyn, part[:, :taps].sum(0)


class BlockConvTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dynamic, base, block_size, group_size, pinned):
        base_x = base.to(x.dtype).contiguous()
        ctx.save_for_backward(x, dynamic, base_x)
        ctx.args, ctx.base_dtype = (block_size, group_size, pinned), base.dtype
        return conv_forward(x, dynamic, base_x, block_size, group_size, pinned)

    @staticmethod
    def backward(ctx, do):
        x, dynamic, base_x = ctx.saved_tensors
        dx, ddyn, dbase = conv_backward(do.contiguous(), x, dynamic, base_x, *ctx.args)
        return dx, ddyn, dbase.to(ctx.base_dtype), None, None, None


def compile_cases(hidden: int, group: int = 16, taps: int = 2, block_size: int = 16) -> list:
    """(autotuned kernel, constexprs) as the op launches them."""
    c = _constexprs(hidden, group, taps, block_size)
    return [(_fwd_kernel, c), (_bwd_kernel, {**c, "KP": triton.next_power_of_2(taps)})]
