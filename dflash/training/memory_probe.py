"""Tensor bytes of a training step by phase: what `launch/measure_memory.py` sets against the plan.

The CPU has no allocator statistics, so `TensorBytes` counts every tensor storage an op creates
until it dies (as `dflash.models.flops.measure_peak_tensor_bytes`), and `PhaseMemory` books the
peak of each span between the trainer's phase marks (`dflash.training.phases`) to that phase:
the target's features, the drafter's forward, the loss, the backward, the optimizer step, and
"other" (the micro-batches' copy to the device, the collectives); "between steps" is what stays
alive from one step to the next.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dflash.training.phases import PhaseTimer


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


class PhaseMemory(PhaseTimer):
    """A `PhaseTimer` whose marks book the peak tensor bytes of each span (not its seconds) to the
    span's phase, the largest over all steps: `peaks` by phase, and "between steps", the bytes
    alive when a step starts."""

    def __init__(self, device, drafter, counter: TensorBytes):
        super().__init__(device, drafter)
        self.counter = counter
        self.peaks: dict[str, int] = defaultdict(int)

    def start(self) -> None:
        super().start()
        self.peaks["between steps"] = max(self.peaks["between steps"], self.counter.live)
        self.counter.reset_span()

    def mark(self, phase: str) -> None:
        if self._marks is not None:
            self.peaks[phase] = max(self.peaks[phase], self.counter.span_peak)
            self.counter.reset_span()
