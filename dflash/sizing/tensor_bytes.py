"""Tensor bytes the CPU can count: it has no allocator statistics, so `TensorBytes` tracks every
tensor storage an op creates until it dies, and its peak after each op (exact at op granularity on
any device). The memory plan's tests and `launch/measure_memory.py` measure with it."""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_expired = torch.UntypedStorage._expired  # the C check itself: StorageWeakRef.expired wraps it twice


class TensorBytes(TorchDispatchMode):
    """Live bytes of the storages created by ops while active (`live`), their peak (`peak`) and the
    peak since `reset_span()` (`span_peak`). Tensors older than the mode are not counted.

    Which storages died is looked up only when it could matter: the bytes alive at the last look-up
    plus those created since bound the live bytes from above, and while that bound stays under the
    span's peak no peak can move (the same peaks as a look-up after every op, at a fraction of the
    ops' cost: a step's ops are tens of thousands, its storages hundreds)."""

    def __init__(self):
        super().__init__()
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}  # by the storage's address
        self._live = self._bound = self.peak = self.span_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views and in-place results alias an input: tracked already, or older than the mode
        inputs = {a.untyped_storage()._cdata for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in inputs and storage._cdata not in self._storages:
                    self._storages[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self._bound += storage.nbytes()
        if self._bound > self.span_peak:
            self.span_peak = max(self.span_peak, self.live)
            self.peak = max(self.peak, self.span_peak)
        return out

    @property
    def live(self) -> int:
        """Bytes of the tracked storages alive now."""
        self._storages = {k: v for k, v in self._storages.items() if not _expired(k)}
        self._live = self._bound = sum(n for _, n in self._storages.values())
        return self._live

    def reset_span(self) -> None:
        self.span_peak = self.live


def measure_peak_tensor_bytes(fn, *args, **kwargs) -> tuple[int, object]:
    """(peak bytes of the tensor storages created while `fn` runs, forward and backward alike; its result)."""
    with TensorBytes() as counter:
        result = fn(*args, **kwargs)
    return counter.peak, result
