"""The precision rule every entry point shares: "auto" trains and decodes in bf16 on a GPU and in
fp32 on the CPU (CPU bf16 matmuls are slow and the demo's numbers are fp32)."""
from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """`name`: "auto", "bf16" or "fp32"."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto, bf16 or fp32, got {name!r}")
    return DTYPES[name]
