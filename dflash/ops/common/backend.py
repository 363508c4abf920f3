"""Backend choice: Triton when it can run, the plain-torch reference otherwise."""
from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = ("auto", "triton", "torch")


def is_interpreting() -> bool:
    """True when Triton kernels run on the CPU through the numpy interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map the user's `backend` to "triton" or "torch", or raise with what is missing."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    usable = HAS_TRITON and (device.type == "cuda" or (device.type == "cpu" and is_interpreting()))
    if backend == "auto":
        return "triton" if HAS_TRITON and device.type == "cuda" else "torch"
    if not HAS_TRITON:
        raise RuntimeError('backend="triton" needs the triton package, which is not importable; '
                           'use backend="torch" or "auto"')
    if not usable:
        raise RuntimeError(f'backend="triton" runs on CUDA tensors, or on CPU tensors with '
                           f"TRITON_INTERPRET=1 set before triton is imported; got device {device}")
    return "triton"
