"""Public entry point of packed varlen attention (validation, defaults, backend dispatch)."""
from __future__ import annotations

import torch

from ..common.backend import auto_falls_back, resolve_backend
from ..common.checks import check_cu_seqlens, check_index, check_max_seqlen, check_qkv
from .naive import varlen_attention_naive


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    cu_seqlens_cpu: torch.Tensor | None = None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """Attention inside each packed sample, never across samples (differentiable).

    Args:
        q: (T, Hq, D) float32/bfloat16/float16, all samples' rows concatenated.
        k, v: (T, Hkv, D), same dtype and device; Hq a multiple of Hkv. Query head h reads
            key/value head h // (Hq // Hkv) (GQA, K/V are never repeated).
        cu_seqlens: int32 (S+1,), sample i is rows [cu[i], cu[i+1]); cu[0] = 0, cu[S] = T,
            non-decreasing (checked on cu_seqlens_cpu when given, on CUDA without a host sync).
        max_seqlen: length of the longest sample (a Python int). Checked against cu_seqlens_cpu when
            given; the Triton kernels never rely on it (a wrong value cannot drop rows).
        causal: row i of a sample sees keys 0..i of that sample (else all of them).
        softmax_scale: defaults to D ** -0.5.
        backend: one of dflash.ops.ATTENTION_BACKENDS: "triton", "torch" (the per-sample
            reference), "auto" (Triton on CUDA, the reference elsewhere), "torch_varlen"
            (torch.nn.attention.varlen, CUDA), "flash_attn" (flash_attn_varlen_func, CUDA, when
            installed) or "flex" (FlexAttention with a document mask; forward only on the CPU).
            The library backends need a true max_seqlen.
        cu_seqlens_cpu: optional CPU copy of cu_seqlens; with it the Triton launcher sizes
            its grid exactly without reading cu_seqlens back from the device.
        deterministic: Triton backward only. False: dQ is accumulated with atomics (5 GEMMs per
            tile pair; its last bits vary from run to run). True: a second kernel recomputes it
            in a fixed order (7 GEMMs, bitwise repeatable), as flash-attn's `deterministic=True`.
            None (default): `torch.are_deterministic_algorithms_enabled()`.

    Returns:
        (T, Hq, D) in q's dtype.

    Causal mask of two packed samples of lengths 3 and 2 (x = visible)::

        x . . . .
        x x . . .
        x x x . .
        . . . x .
        . . . x x

    Example:
        >>> out = varlen_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen)
    """
    check_qkv(q, k, v)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows but k/v have {k.shape[0]}")
    check_index("cu_seqlens", cu_seqlens, q.device)
    check_cu_seqlens("cu_seqlens", cu_seqlens, q.shape[0], cu_seqlens_cpu)
    if cu_seqlens_cpu is not None:
        check_max_seqlen(cu_seqlens_cpu, max_seqlen)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if not scale > 0:  # the kernels take the row maximum of unscaled scores
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    impl = resolve_backend(backend, q.device)
    if impl == "torch":
        return varlen_attention_naive(q, k, v, cu_seqlens, causal=causal, softmax_scale=scale)
    if impl != "triton":
        from .libraries import varlen_attention_library

        return varlen_attention_library(impl, q, k, v, cu_seqlens, int(max_seqlen), causal, scale)
    from .triton_kernels import unservable, varlen_attention_triton

    deterministic = torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic)
    if backend == "auto" and auto_falls_back(unservable, q.shape[-1], q.shape[1], k.shape[1], q.dtype, causal,
                                             deterministic):
        from .libraries import varlen_attention_library

        return varlen_attention_library("flex", q, k, v, cu_seqlens, int(max_seqlen), causal, scale)
    return varlen_attention_triton(q, k, v, cu_seqlens, causal, scale, cu_seqlens_cpu, deterministic)
