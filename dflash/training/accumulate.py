"""One optimizer step's gradients on this rank: micro-batches -> target features -> drafter -> loss
-> backward, each micro-batch's loss scaled by the loss weight of the whole step on all ranks."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dflash.data.cost import FEATURES
from dflash.training.step_metrics import Accumulated

ROW_KEYS = FEATURES.index("row_keys")


def shape(micro_batch, block_size: int) -> tuple[int, int, int]:
    """(computed tokens, drafter rows, rows x sample length summed): what the memory plan prices."""
    m = micro_batch
    return m.computed_tokens, m.blocks.num_blocks * block_size, int(m.cost_features[ROW_KEYS])


class Walked(list):
    """A step's micro-batches; `current` is the one the latest walk over them reached (the one that
    ran out of memory, when a step does)."""

    current = None

    def __iter__(self):
        for item in super().__iter__():
            self.current = item
            yield item


def accumulate_gradients(engine, target, loss, micro: list, device, block_size: int, timings: list | None = None,
                         phases=None, *, noise=None, epoch: int = 0):
    """Forward and backward of one step's micro-batches on this rank.

    Each micro-batch's loss sum is divided by the loss weight of the WHOLE step (all its
    micro-batches on all ranks), so the accumulated gradient is that of one big batch.
    Returns this rank's sums (`Accumulated`: device tensors of loss, weight, tau, blocks and the slots'
    counts, the skipped samples, the loss's named metrics, `LossOutput.metrics`, e.g. a candidate
    selector's counts, the same names on every rank); nothing here waits for the device,
    unless `timings` is a list: then each micro-batch's seconds (forward and backward, the device
    synchronised) are appended.
    `phases` (a PhaseTimer, started) is marked after each phase. `noise`: a `FeatureNoise` for the
    tapped features of `epoch`. A loss whose terms read the target's distribution (KL, LK) gets the
    target's final states, from the same target forward.
    """
    from dflash.objective.anchors import to_packed
    from dflash.objective.terms import needs_target_states, target_context

    if timings is not None:
        from deepspeed.accelerator import get_accelerator
    world_size = dist.get_world_size()
    total = torch.tensor(sum(m.weight_sum for m in micro), dtype=torch.float64, device=device)
    dist.all_reduce(total)  # the step's only collective of ours; the result stays on the device
    # DeepSpeed averages gradients over ranks; scaling by the world size makes that a sum.
    scale = (world_size / total.clamp_min(1e-12)).float()
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    slot = torch.zeros(2, block_size - 1, dtype=torch.float64, device=device)
    skipped, named = 0, {}
    for mb in micro:
        start = time.perf_counter()
        batch, blocks = mb.batch.to(device, non_blocking=True), mb.blocks.to(device, non_blocking=True)
        if phases:
            phases.mark("other")
        context = None
        if needs_target_states(loss):
            features, states = target.features(batch, with_output=True)
            context = target_context(states, to_packed(batch))
        else:
            features = target.features(batch)
        if noise is not None:
            features = noise(features, to_packed(batch), epoch)
        if phases:
            phases.mark("target_forward")
        # a hook marks the drafter's end
        out = loss(engine(batch, features, blocks), blocks, engine.module.lm_head, context=context)
        if phases:
            phases.mark("loss")
        engine.backward(out.loss_sum * scale, scale_wrt_gas=False)
        if phases:
            phases.mark("drafter_backward")
        if timings is not None:
            get_accelerator().synchronize()
            timings.append(time.perf_counter() - start)
        sums += torch.stack([out.loss_sum.detach().double(), out.weight_sum.double(), out.tau_sum.double(),
                             torch.tensor(float(out.num_blocks), dtype=torch.float64, device=device)])
        slot += torch.stack([out.slot_correct, out.slot_count]).double()
        skipped += out.num_skipped
        for k, v in out.metrics.items():
            named[k] = named.get(k, 0.0) + v.double()
    return Accumulated(sums, slot, skipped, named)
