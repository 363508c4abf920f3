"""Tensor bytes the CPU can count: it has no allocator statistics, so `TensorBytes` tracks every
tensor storage an op creates until it dies, and its peak after each op (exact at op granularity on
any device). The memory plan's tests and `launch/measure_memory.py` measure with it."""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorBytes(TorchDispatchMode):
    """Live bytes of the storages created by ops while active (`live`), their peak (`peak`) and the
    peak since `reset_span()` (`span_peak`). Tensors older than the mode are not counted."""

    def __init__(self):
        super().__init__()
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = self.peak = self.span_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views and in-place results alias an input: tracked already, or older than the mode
        inputs = {StorageWeakRef(a.untyped_storage()).cdata
                  for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in inputs:
                    self._storages.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        self._storages = {k: v for k, v in self._storages.items() if not v[0].expired()}
        self.live = sum(n for _, n in self._storages.values())
        self.peak, self.span_peak = max(self.peak, self.live), max(self.span_peak, self.live)
        return out

    def reset_span(self) -> None:
        self.span_peak = self.live


def measure_peak_tensor_bytes(fn, *args, **kwargs) -> tuple[int, object]:
    """(peak bytes of the tensor storages created while `fn` runs, forward and backward alike; its result)."""
    with TensorBytes() as counter:
        result = fn(*args, **kwargs)
    return counter.peak, result
