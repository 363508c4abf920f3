"""Public entry points of the Gated DeltaNet ops on packed rows (validation, backend dispatch).

Backends: "torch" (the references in naive.py, any device, exact in fp32) and "fla"
(flash-linear-attention's Triton kernels with `cu_seqlens`, CUDA, bfloat16/float16; the optional
extra `pip install dflash[fla]`). "auto" takes "fla" on CUDA when it is installed and the inputs
are half precision, the reference otherwise (saying once on CUDA that fla would be faster).
"""
from __future__ import annotations

import importlib.util

import torch

from ..common.backend import warn_once
from ..common.checks import check_index
from .naive import causal_conv1d_varlen_naive, gated_delta_rule_varlen_naive

BACKENDS = ("auto", "torch", "fla")


def _resolve(backend: str, x: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"linear-attention backend must be one of {BACKENDS}, got {backend!r}")
    installed = importlib.util.find_spec("fla") is not None
    if backend == "fla":
        if not installed:
            raise RuntimeError('backend="fla" needs flash-linear-attention: pip install "dflash[fla]"')
        if x.device.type != "cuda":
            raise RuntimeError(f'backend="fla" runs on CUDA tensors, got device {x.device}')
        return "fla"
    if backend == "auto" and x.device.type == "cuda":
        if installed and x.dtype in (torch.bfloat16, torch.float16):
            return "fla"
        warn_once("gated-delta-reference", "Gated DeltaNet layers run the PyTorch reference (one step per "
                                           'position); flash-linear-attention is much faster on bfloat16: '
                                           'pip install "dflash[fla]"')
    return "torch"


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                         activation: str | None = None, *, backend: str = "auto") -> torch.Tensor:
    """Depthwise causal convolution restarting at every sample: x (T, C), weight (C, W), bias (C,) or
    None, cu_seqlens int32 (S+1,) -> (T, C). Taps before a sample's first row read zero (never the
    previous sample's rows). activation: None, "silu" or "swish"."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x must be (tokens, channels) and weight (channels, width); got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    check_index("cu_seqlens", cu_seqlens, x.device)
    if _resolve(backend, x) == "torch":
        return causal_conv1d_varlen_naive(x, weight, bias, cu_seqlens, activation)
    from fla.modules.convolution import causal_conv1d

    out = causal_conv1d(x=x[None], weight=weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens.long())
    return (out[0] if isinstance(out, tuple) else out)[0]


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            cu_seqlens: torch.Tensor, *, scale: float | None = None, use_qk_l2norm: bool = False,
                            backend: str = "auto") -> torch.Tensor:
    """Chunked/recurrent gated delta rule per sample from a zero state (see naive.py for the
    recurrence): q/k (T, Hk, Dk), v (T, Hv, Dv), g (log decay, <= 0) and beta (T, Hv) -> (T, Hv, Dv).
    No state passes from one sample of `cu_seqlens` to the next."""
    t, hk, dk = k.shape
    if q.shape != k.shape or v.dim() != 3 or v.shape[0] != t or v.shape[1] % hk:
        raise ValueError(f"q/k must be (T, Hk, Dk) and v (T, Hv, Dv) with Hv a multiple of Hk; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError(f"g and beta must be (T, Hv) = {tuple(v.shape[:2])}; got {tuple(g.shape)}, "
                         f"{tuple(beta.shape)}")
    check_index("cu_seqlens", cu_seqlens, v.device)
    if _resolve(backend, v) == "torch":
        return gated_delta_rule_varlen_naive(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    group = v.shape[1] // hk  # repeated here: fla versions differ in grouped-value support
    q, k = (x.repeat_interleave(group, dim=1) for x in (q, k))
    out, _ = chunk_gated_delta_rule(q[None], k[None], v[None], g[None].float(), beta[None].to(v.dtype),
                                    scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm,
                                    cu_seqlens=cu_seqlens.long())
    return out[0]
