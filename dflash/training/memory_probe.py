"""Tensor bytes of a training step by phase: what `launch/measure_memory.py` sets against the plan.

The CPU has no allocator statistics, so `TensorBytes` (`dflash.sizing.tensor_bytes`) counts every
tensor storage an op creates until it dies, and `PhaseMemory` books the
peak of each span between the trainer's phase marks (`dflash.training.phases`) to that phase:
the target's features, the drafter's forward, the loss, the backward, the optimizer step, and
"other" (the micro-batches' copy to the device, the collectives); "between steps" is what stays
alive from one step to the next.
"""
from __future__ import annotations

from collections import defaultdict

from dflash.sizing.tensor_bytes import TensorBytes
from dflash.training.phases import PhaseTimer


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
