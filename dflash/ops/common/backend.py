"""Backend choice: Triton when it can run, the plain-torch reference otherwise, or a public
library's kernel (FlexAttention, torch's varlen_attn, flash-attn) when asked for."""
from __future__ import annotations

import importlib.util
import os
import warnings

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Every accepted `backend=` / `--attention-backend` name. torch_varlen and flash_attn are kernels
# for the target's causal varlen attention only; with them the DFlash block attention runs
# through FlexAttention ("flex"), which serves both ops.
ATTENTION_BACKENDS = ("auto", "triton", "torch", "flex", "torch_varlen", "flash_attn")


def is_interpreting() -> bool:
    """True when Triton kernels run on the CPU through the numpy interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device, op: str = "varlen") -> str:
    """Map the user's `backend` to the implementation that `op` ("varlen" or "block") runs on
    `device`: "triton", "torch", "flex", "torch_varlen" or "flash_attn"; raise with what is missing."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if HAS_TRITON and device.type == "cuda" else "torch"
    if backend in ("torch_varlen", "flash_attn") and op == "block":
        backend = "flex"
    if backend == "flex":
        return "flex"  # FlexAttention runs on CUDA and (forward only) on the CPU
    if device.type != "cuda" and not (backend == "triton" and device.type == "cpu" and is_interpreting()):
        hint = " or on CPU tensors with TRITON_INTERPRET=1 set before triton is imported" if backend == "triton" else ""
        raise RuntimeError(f'backend="{backend}" runs on CUDA tensors{hint}; got device {device}')
    if backend == "triton" and not HAS_TRITON:
        raise RuntimeError('backend="triton" needs the triton package, which is not importable; '
                           'use backend="torch" or "auto"')
    if backend == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        raise RuntimeError('backend="flash_attn" needs the flash-attn package, which is not installed; '
                           'use backend="torch_varlen" (the same FlashAttention-2 kernels, shipped with torch)')
    return backend


_FELL_BACK: set = set()
_SAID: set = set()


def warn_once(key, message: str) -> None:
    """warnings.warn(message) the first time `key` is seen in this process."""
    if key not in _SAID:
        _SAID.add(key)
        warnings.warn(message, stacklevel=3)


def auto_falls_back(unservable, *case) -> bool:
    """Whether backend="auto" must leave Triton for FlexAttention because `unservable(*case, cap)`
    (a triton_kernels.unservable) says no config of a needed kernel fits this GPU; warns once per case."""
    from .compile_check import current_capability

    problem = unservable(*case, current_capability())
    if problem and case not in _FELL_BACK:
        _FELL_BACK.add(case)
        warnings.warn(f'{problem}; backend="auto" uses FlexAttention ("flex") for this case', stacklevel=3)
    return problem is not None
