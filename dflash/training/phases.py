"""Where a training step's time goes: target forward, drafter forward and backward, loss, optimizer.

Marks are recorded in the order the work is queued; each closes the span since the previous mark
and books it to the mark's phase. On CUDA a mark is an event on the current stream (no sync: the
spans are read when the step's record syncs anyway); on the CPU, where work runs as it is called,
it is the host clock. The loss is the drafter's chunked lm_head cross-entropy: its forward
computes the gradient too, so its span runs from the drafter's final norm (a forward hook) to the
trainer's mark after the loss, and the backward that follows is the drafter's alone.
"""
from __future__ import annotations

import itertools
import time
from collections import defaultdict

import torch

# The phases of a step, in the order reported; "other" is what lies between them (the batch's
# copy to the device, the step's collectives and host work).
PHASES = ("target_forward", "drafter_forward", "loss", "drafter_backward", "optimizer", "other")


class PhaseTimer:
    """Device time per phase of one step at a time: `start()`, `mark(phase)`..., `seconds()`.

    A hook on `drafter.norm` marks the end of the drafter's layers ("drafter_forward") in every
    training forward (the trainer marks the end of the loss, "loss"); between `seconds()` and the next
    `start()` (eval walks, decoding) they mark nothing.
    """

    def __init__(self, device: torch.device, drafter: torch.nn.Module):
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list | None = None
        self._hooks = [drafter.norm.register_forward_hook(lambda *_: self.mark("drafter_forward"))]

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [(None, self._now())]

    def mark(self, phase: str) -> None:
        if self._marks is not None:
            self._marks.append((phase, self._now()))

    def seconds(self) -> dict[str, float]:
        """Seconds per phase since `start()` (call once the device has finished the step's work)."""
        marks, self._marks = self._marks or [], None
        spent = defaultdict(float)
        for (_, begin), (phase, end) in itertools.pairwise(marks):
            spent[phase] += begin.elapsed_time(end) / 1e3 if self.cuda else end - begin
        return {phase: spent.get(phase, 0.0) for phase in PHASES}

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
