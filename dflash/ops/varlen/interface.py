"""Public entry point of packed varlen attention (validation, defaults, backend dispatch)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..common.backend import auto_falls_back, resolve_backend, warn_once
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
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
    cu_seqlens_cpu: torch.Tensor | None = None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """Attention inside each packed sample, never across samples (differentiable).

    Args:
        q: (T, Hq, D) float32/bfloat16/float16, all samples' rows concatenated.
        k: (T, Hkv, D), v: (T, Hkv, Dv), same dtype and device; Hq a multiple of Hkv. Query head h
            reads key/value head h // (Hq // Hkv) (GQA, K/V are never repeated). Dv may differ from
            D (multi-head latent attention: 192 vs 128 in DeepSeek-V3).
        cu_seqlens: int32 (S+1,), sample i is rows [cu[i], cu[i+1]); cu[0] = 0, cu[S] = T,
            non-decreasing (checked on cu_seqlens_cpu when given, on CUDA without a host sync).
        max_seqlen: length of the longest sample (a Python int). Checked against cu_seqlens_cpu when
            given; the Triton kernels never rely on it (a wrong value cannot drop rows).
        causal: row i of a sample sees keys 0..i of that sample (else all of them).
        softmax_scale: defaults to D ** -0.5.
        window: sliding window (causal only): row i sees keys i - window < j <= i of its sample,
            `window` keys with its own, as transformers' `sliding_window`. None: no window.
        sinks: (Hq,) attention-sink logits (gpt-oss): each head's softmax has one more key with
            that logit and a zero value, so a row's weights sum to less than one.
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

    With a window, sinks, or head dims the Triton kernels do not take (Dv != D, D not a power of
    two: q/k/v are zero-padded to one, which is exact), the Triton backend runs forward only
    (enough for the frozen target); the window is in its forward kernel.

    Returns:
        (T, Hq, Dv) in q's dtype.

    Causal mask of two packed samples of lengths 3 and 2 (x = visible)::

        x . . . .
        x x . . .
        x x x . .
        . . . x .
        . . . x x

    Example:
        >>> out = varlen_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen)
    """
    check_qkv(q, k, v, value_head_dim=True)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows but k/v have {k.shape[0]}")
    check_index("cu_seqlens", cu_seqlens, q.device)
    check_cu_seqlens("cu_seqlens", cu_seqlens, q.shape[0], cu_seqlens_cpu)
    if cu_seqlens_cpu is not None:
        check_max_seqlen(cu_seqlens_cpu, max_seqlen)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if not scale > 0:  # the kernels take the row maximum of unscaled scores
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    window = _check_window(window, causal)
    _check_sinks(sinks, q)
    impl = resolve_backend(backend, q.device)
    if impl == "torch":
        return varlen_attention_naive(q, k, v, cu_seqlens, causal=causal, softmax_scale=scale, window=window,
                                      sinks=sinks)
    if impl != "triton":
        from .libraries import varlen_attention_library

        return varlen_attention_library(impl, q, k, v, cu_seqlens, int(max_seqlen), causal, scale, window, sinks)
    from .triton_kernels import unservable, varlen_attention_triton

    deterministic = torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic)
    dim = _triton_head_dim(q.shape[-1], v.shape[-1])
    if backend == "auto" and auto_falls_back(unservable, dim, q.shape[1], k.shape[1], q.dtype, causal, deterministic):
        from .libraries import varlen_attention_library

        return varlen_attention_library("flex", q, k, v, cu_seqlens, int(max_seqlen), causal, scale, window, sinks)
    if dim == q.shape[-1] == v.shape[-1] and sinks is None and window is None:
        return varlen_attention_triton(q, k, v, cu_seqlens, causal, scale, cu_seqlens_cpu, deterministic)
    return _triton_forward_only(q, k, v, cu_seqlens, causal, scale, cu_seqlens_cpu, dim, window, sinks)


def _check_window(window, causal: bool) -> int | None:
    if window is None:
        return None
    if isinstance(window, bool) or int(window) != window or window < 1:
        raise ValueError(f"window must be a positive int (keys a row sees, its own included), got {window!r}")
    if not causal:
        raise ValueError("a sliding window is defined for causal attention only")
    return int(window)


def _check_sinks(sinks, q) -> None:
    if sinks is None:
        return
    if sinks.shape != (q.shape[1],) or not sinks.is_floating_point() or sinks.device != q.device:
        raise ValueError(f"sinks must be a float tensor of shape ({q.shape[1]},) (one logit per query head) on "
                         f"{q.device}, got {sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")


def _triton_head_dim(d: int, dv: int) -> int:
    """The head dim the Triton kernels run: the power of two (>= 16) at or above both head dims."""
    return max(16, 1 << (max(d, dv) - 1).bit_length())


def _triton_forward_only(q, k, v, cu_seqlens, causal, scale, cu_seqlens_cpu, dim, window, sinks):
    """Triton forward with a sliding window, zero-padded head dims (q.k and the padded value columns
    add exact zeros) and sinks folded in from the kernel's log-sum-exp; no autograd."""
    from .libraries import apply_sinks
    from .triton_kernels import check_triton_inputs, varlen_fwd

    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks) if t is not None):
        raise NotImplementedError('the Triton varlen kernels run sliding windows, attention sinks and padded head '
                                  'dims forward only; use backend="torch" or "flex" for gradients')
    dv = v.shape[-1]
    if dim != q.shape[-1] or dim != dv:
        warn_once(("padded", q.shape[-1], dv), f"q/k head dim {q.shape[-1]} and v head dim {dv}: the Triton varlen "
                                               f"kernels run them zero-padded to {dim} (exact, more work)")
    q, k, v = (F.pad(t, (0, dim - t.shape[-1])).contiguous() for t in (q, k, v))
    check_triton_inputs(q)
    out, lse = varlen_fwd(q, k, v, cu_seqlens.contiguous(), causal, scale, cu_seqlens_cpu, window=window)
    out = out[..., :dv]
    return out if sinks is None else apply_sinks(out, lse * math.log(2), sinks)  # lse is in base 2
