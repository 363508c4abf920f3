"""Public entry point of the DFlash2 block convolution (validation, backend dispatch), and the
recomputing autograd Function of the CPU path."""
from __future__ import annotations

import torch

from ..common.backend import HAS_TRITON, is_interpreting
from .naive import block_conv_naive

BACKENDS = ("auto", "triton", "torch")


class _Recomputed(torch.autograd.Function):
    """The reference without its graph: the forward keeps only its inputs, the backward runs the
    reference again with autograd (one convolution's graph at a time, freed at once)."""

    @staticmethod
    def forward(ctx, x, dynamic, base, block_size, group_size):
        ctx.save_for_backward(x, dynamic, base)
        ctx.args = (block_size, group_size)
        return block_conv_naive(x, dynamic, base, block_size, group_size)

    @staticmethod
    def backward(ctx, do):
        leaves = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad,
                                                                     strict=False)]
        with torch.enable_grad():
            out = block_conv_naive(*leaves, *ctx.args)
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, do)) if wanted else iter(())
        return (*(next(grads) if t.requires_grad else None for t in leaves), None, None)


def _triton_serves(x: torch.Tensor, group_size: int) -> bool:
    """The kernels reduce a whole group inside a tile: a power-of-two group; fp32/bf16/fp16."""
    return group_size & (group_size - 1) == 0 and x.dtype != torch.float64


def block_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int, *,
               backend: str = "auto", deterministic: bool | None = None) -> torch.Tensor:
    """DFlash2's block-local dynamic grouped causal convolution (differentiable in all three tensors).

    Args:
        x: (NB*B, H) float32/bfloat16/float16, block-major: rows [j*B, (j+1)*B) are block j.
        dynamic: (NB*B, K, H/G) in x's dtype, the per-row weights of each tap and channel group (any row
            stride: a slice of the kernel projection's output is taken as is).
        base: (K, H), the static kernel (cast to x's dtype, as the reference does).
        block_size: B. group_size: G, channels per group, dividing H.
        backend: "triton" (CUDA, or CPU with TRITON_INTERPRET=1), "torch" (the reference, recomputed in
            backward), "auto" (Triton on CUDA for a power-of-two G, else "torch").
        deterministic: Triton only; True runs pinned configs (no timing). None:
            `torch.are_deterministic_algorithms_enabled()`. The kernels use no atomics either way.

    Returns:
        (NB*B, H) in x's dtype: out[t, c] = sum_i (base[i, c] + dynamic[t, i, c // G]) x[t - i, c], the
        sum over taps i < K with t - i in t's block (slot k reads slots k .. k-K+1 of its own block).

    For backward both backends keep x, dynamic and base only, and recompute the rest.

    Example:
        >>> y = block_conv(h, proj(h).view(h.shape[0], 2, K, -1)[:, 0], conv.base_kernel[0], 16, 16)
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if x.dim() != 2 or base.dim() != 2 or dynamic.dim() != 3:
        raise ValueError(f"x must be (rows, H), dynamic (rows, K, H/G) and base (K, H), got {tuple(x.shape)}, "
                         f"{tuple(dynamic.shape)} and {tuple(base.shape)}")
    rows, hidden = x.shape
    taps = base.shape[0]
    if block_size < 1 or rows % block_size:
        raise ValueError(f"x has {rows} rows, not a multiple of block_size {block_size}")
    if group_size < 1 or hidden % group_size:
        raise ValueError(f"group_size {group_size} does not divide the hidden size {hidden}")
    if taps < 1 or base.shape[1] != hidden or tuple(dynamic.shape) != (rows, taps, hidden // group_size):
        raise ValueError(f"with x {tuple(x.shape)} and base {tuple(base.shape)}, dynamic must be "
                         f"{(rows, taps, hidden // group_size)}, got {tuple(dynamic.shape)}")
    if dynamic.dtype != x.dtype or not x.is_floating_point():
        raise TypeError(f"x and dynamic must share a float dtype, got {x.dtype} and {dynamic.dtype}")
    if not (x.device == dynamic.device == base.device):
        raise ValueError(f"x, dynamic and base must be on one device, got {x.device}, {dynamic.device}, "
                         f"{base.device}")
    on_triton = x.is_cuda or (x.device.type == "cpu" and is_interpreting())
    if backend == "triton" and not (HAS_TRITON and on_triton and _triton_serves(x, group_size)):
        raise RuntimeError(f'backend="triton" needs triton, CUDA tensors (or TRITON_INTERPRET=1 on the CPU), '
                           f'a power-of-two group_size and no float64; got {x.device}, {x.dtype}, G={group_size}')
    use_triton = backend == "triton" or (backend == "auto" and HAS_TRITON and x.is_cuda
                                         and _triton_serves(x, group_size))
    if not use_triton or rows == 0:  # (no grid to launch for no rows)
        return _Recomputed.apply(x, dynamic, base, block_size, group_size)
    from .triton_kernels import BlockConvTriton

    if dynamic.stride(2) != 1 or dynamic.stride(1) != hidden // group_size:
        dynamic = dynamic.contiguous()
    pinned = torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic)
    return BlockConvTriton.apply(x.contiguous(), dynamic, base, block_size, group_size, pinned)
