"""The metrics part: one optimizer step's result (`StepResult`: what `accumulate_gradients` summed on
this rank, with the step's timing) reduced over the ranks and named as `metrics.jsonl` records it. The
loss terms name their own figures (`BlockLoss.figures`: a drafter kind's among them)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from dflash.training.metrics import step_metrics


class Accumulated(NamedTuple):
    """One step's sums on this rank (`accumulate_gradients`), device tensors: nothing waits for them."""

    sums: torch.Tensor  # (4,) float64: loss sum, weight sum, tau sum, blocks
    slot: torch.Tensor  # (2, B-1) float64: correct and scored labels per slot
    skipped: int  # samples skipped for too few supervised tokens
    named: dict  # the loss terms' named sums (`LossOutput.metrics`), the same names on every rank


class StepResult(NamedTuple):
    """One optimizer step as the metrics part reads it."""

    accumulated: Accumulated
    epoch: int
    micro: list  # this rank's micro-batches
    started: float  # perf_counter at the step's start
    busy: float  # seconds of work before the step's collectives (nan: not measured on this step)
    waited: float  # seconds waited there for the slowest rank (nan: not measured)
    applied: bool  # the optimizer applied the update (finite gradients)
    timings: list | None  # seconds of each micro-batch, when timed


class StepMetrics:
    """Reduces a `StepResult` over the ranks and names the figures (a sync point: each rank's own time,
    its queued device work included, and work in its slot, so one all-reduce gathers them all).
    `figures`: the loss terms' figures of their named sums; `phases`: the phase timer, if any."""

    def __init__(self, device, world_size: int, rank: int, figures: Callable[[dict, float], dict], phases=None):
        self.device, self.world_size, self.rank = device, world_size, rank
        self.figures, self.phases = figures, phases

    def record(self, result: StepResult, *, target_memory: dict, lr: float, grad_norm,
               nonfinite_steps: int) -> dict:
        """The step's record, the same on every rank; `target_memory`: the target's resident and gathered
        bytes on this rank; `lr`, `grad_norm`, `nonfinite_steps`: the optimizer's state after the step."""
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize()
        micro, acc = result.micro, result.accumulated
        own = time.perf_counter() - result.started
        per_rank = torch.zeros(7, self.world_size, dtype=torch.float64, device=self.device)
        per_rank[:, self.rank] = torch.tensor([own, sum(m.real_tokens for m in micro),
                                               sum(m.computed_tokens for m in micro), result.busy, result.waited,
                                               target_memory["resident"], target_memory["gathered"]],
                                              dtype=torch.float64)
        names = sorted(acc.named)  # the loss's metric sums ride with the counts
        counts = torch.cat([torch.tensor([acc.skipped, len(micro)], dtype=torch.float64, device=self.device),
                            *([torch.stack([acc.named[k] for k in names])] if names else [])])
        sums, slot = acc.sums, acc.slot
        for t in (sums, slot, per_rank, counts):
            dist.all_reduce(t)
        seconds = time.perf_counter() - result.started
        rank_seconds, rank_real, rank_computed, rank_busy, rank_waited, resident, gathered = per_rank.tolist()
        real, computed = sum(rank_real), sum(rank_computed)
        metrics = step_metrics(sums.tolist(), slot)
        measured = not bool(per_rank[3:5].isnan().any())  # only on the steps planned for a log
        record = {
            "epoch": result.epoch, "loss": metrics["loss"], "anchor_tau": metrics["anchor_tau"], "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "step_seconds": seconds, "real_tokens": int(real), "computed_tokens": int(computed),
            "tokens_per_s": real / seconds, "computed_tokens_per_s": computed / seconds,
            "efficiency": real / computed, "micro_batches": int(counts[1]) // self.world_size,
            "skipped_samples": int(counts[0]), "step_applied": result.applied, "nonfinite_steps": nonfinite_steps,
            "slot_accuracy": metrics["slot_accuracy"],
            "rank_seconds": rank_seconds, "rank_computed_tokens": [int(c) for c in rank_computed],
            # per rank: seconds of work before the step's collectives, and seconds waited there for the slowest
            "rank_busy_seconds": rank_busy if measured else None,
            "rank_wait_seconds": rank_waited if measured else None,
            "wait_fraction": sum(rank_waited) / (self.world_size * seconds) if measured else None,
            # per rank: target parameters held between forwards, and the most gathered at once (partitioned)
            "target_resident_bytes": [int(b) for b in resident], "target_gathered_bytes": [int(b) for b in gathered],
        }
        if names:  # the loss terms' figures, summed as one big batch
            record.update(self.figures(dict(zip(names, counts[2:].tolist(), strict=True)), metrics["blocks"]))
        if result.timings is not None:  # every rank's micro-batches: cost features and measured seconds
            mine = [[*m.cost_features.tolist(), t] for m, t in zip(micro, result.timings, strict=True)]
            every = [None] * self.world_size
            dist.all_gather_object(every, mine)
            record["micro_batch_costs"] = [row for rank_rows in every for row in rank_rows]
        if self.phases:  # this rank's device seconds per phase (the device has finished: synchronised above)
            record["phase_seconds"] = self.phases.seconds()
        if self.device.type == "cuda":  # for the config tuner: what this rank's step needed at most
            record["peak_memory_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return record
