"""The frozen target partitioned across all ranks by DeepSpeed ZeRO-3 (`--target-partition zero3`).

Every rank holds 1/W of each target parameter (optionally in CPU memory, `--target-offload`);
a layer's parameters are gathered just before it runs and released after, while the next
layer's are fetched (prefetch sized to the largest decoder layer). The model is built under
`deepspeed.zero.Init` by transformers' own ZeRO-3 loading (`HfDeepSpeedConfig`), so no rank
ever holds a full copy, and the checkpoint's tensor layout conversions (fused MoE experts,
renamed prefixes) apply as in a plain `from_pretrained`. The gathered parameters are the
stored values, so the features are bitwise those of a replicated target.

The drafter borrows the target's embedding and lm_head in every forward and backward: they are
gathered once into plain tensors, replicated on every rank, beside their partitions.

Every rank must run the same feature forwards in the same order (each layer's gather is a
collective); the trainer's micro-steps do, and the evaluator pads its walk to equal rounds.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from dflash.sizing.memory import gib
from dflash.target.model import SharedWeights, TargetModel
from dflash.target.spec import TargetSpec

_MEASURED_CALLS = 3  # feature forwards whose gathered bytes are measured (the 1st records the trace, then prefetch)


def target_zero3_config(spec: TargetSpec, dtype: torch.dtype, *, offload: bool, device, hf=None) -> dict:
    """DeepSpeed config of the frozen target: ZeRO-3 over all ranks, no optimizer.

    Parameters up to hidden-size elements (norms, biases) stay gathered after their first use.
    With `hf` (the partitioned model), the prefetch bucket is its largest decoder layer, and at
    most two such layers are gathered at once (DeepSpeed prefetches at every module until that
    limit): the running one and the next.
    """
    import torch.distributed as dist

    zero = {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": spec.hidden_size}
    if hf is not None:
        layer = largest_layer_numel(hf)
        zero.update(stage3_prefetch_bucket_size=layer, stage3_max_live_parameters=2 * layer)
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.device(device).type == "cuda"}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "train_batch_size": dist.get_world_size(), "zero_optimization": zero,
            "bf16": {"enabled": dtype == torch.bfloat16}, "steps_per_print": 10**9, "wall_clock_breakdown": False}


@contextmanager
def zero3_loading(ds_config: dict):
    """Inside, transformers' `from_pretrained` builds the model under `deepspeed.zero.Init` and
    loads the checkpoint module by module straight into the partitions (`HfDeepSpeedConfig`)."""
    from transformers.integrations import HfDeepSpeedConfig

    zero3 = HfDeepSpeedConfig(ds_config)  # transformers holds a weak reference: it acts while this lives
    try:
        yield
    finally:
        del zero3


def _bytes(param) -> int:
    return param.ds_numel * param.element_size()


class _GatherMeter:
    """The most bytes of target parameters gathered at once, read before every module with
    parameters runs (after DeepSpeed's fetch) during the first feature forwards."""

    def __init__(self, module: nn.Module):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self._gone = ZeroParamStatus.NOT_AVAILABLE
        self.params = list(module.parameters())
        self.peak = 0
        self.calls = 0
        self._handles = [m.register_forward_pre_hook(self._read) for m in module.modules()
                         if any(True for _ in m.parameters(recurse=False))]

    def _read(self, *_):
        self.peak = max(self.peak, sum(_bytes(p) for p in self.params if p.ds_status != self._gone))

    def call_done(self) -> None:
        self.calls += 1
        if self.calls >= _MEASURED_CALLS:
            for h in self._handles:
                h.remove()
            self._handles = []


class PartitionedTarget(nn.Module):
    """A `TargetModel` whose parameters are partitioned across the ranks (ZeRO-3 inference).

    Offers what the trainer uses of a TargetModel: `features(batch)` (collective: every rank
    calls it alike), `target_layer_ids`, `num_embedding_rows`, `config`, `model` (the Hugging
    Face model, partitioned) and `shared_weights()` (replicated copies).
    """

    def __init__(self, target: TargetModel, ds_config: dict):
        import deepspeed

        super().__init__()
        self.target = target
        self.offloaded = "offload_param" in ds_config["zero_optimization"]
        embed, lm_head = target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight
        with deepspeed.zero.GatheredParameters(list({id(p): p for p in (embed, lm_head)}.values())):
            copy = embed.detach().clone()
            self._shared = SharedWeights(copy, copy if lm_head is embed else lm_head.detach().clone())
        # No optimizer: DeepSpeed only sets up fetching and releasing (DeepSpeedZeRoOffload). Kept out
        # of the module tree (the engine wraps this module).
        self.__dict__["engine"] = deepspeed.initialize(model=self, config=ds_config)[0]
        self.meter = _GatherMeter(target.model)

    def forward(self, batch, with_output: bool = False):
        return self.target.features(batch, with_output=with_output)

    @torch.no_grad()
    def features(self, batch, *, with_output: bool = False):
        """`TargetModel.features`, collective."""
        out = self(batch, with_output)  # through __call__: DeepSpeed's hooks on this module start each forward
        if self.meter.calls < _MEASURED_CALLS:
            self.meter.call_done()
        return out

    @property
    def target_layer_ids(self) -> list[int]:
        return self.target.target_layer_ids

    @property
    def config(self):
        return self.target.config

    @property
    def model(self):
        return self.target.model

    @property
    def num_embedding_rows(self) -> int:
        return int(self.target.model.get_input_embeddings().weight.ds_shape[0])

    def shared_weights(self) -> SharedWeights:
        return self._shared

    def resident_bytes(self) -> int:
        """Bytes of target parameters this rank holds between forwards: its partitions (on the
        device, or in CPU memory with offload) and the small parameters kept gathered."""
        params = list(self.target.model.parameters())
        own = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params)
        return own + sum(_bytes(p) for p in params if getattr(p, "ds_persist", False))

    def shared_bytes(self) -> int:
        """The drafter's replicated copies of the embedding and lm_head."""
        s = self._shared
        return sum(t.numel() * t.element_size() for t in {id(s.embed): s.embed, id(s.lm_head): s.lm_head}.values())

    def gathered_peak_bytes(self) -> int:
        return self.meter.peak


def largest_layer_numel(hf) -> int:
    """Elements of the largest decoder layer (partitioned parameters report their full size)."""
    layers = hf.base_model.layers
    return max(sum(getattr(p, "ds_numel", p.numel()) for p in layer.parameters()) for layer in layers)


def full_bytes(hf) -> int:
    """Bytes of all target parameters, replicated or partitioned."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in hf.parameters())


def target_bytes(model) -> dict:
    """Bytes of target parameters on this rank, for a `TargetModel` or a `PartitionedTarget`:
    `full` (the whole target), `resident` (held between forwards), `shared` (the drafter's own
    copies of the embedding and lm_head; 0 when it borrows the target's), `gathered` (the most
    gathered at once so far; 0 when replicated)."""
    full = full_bytes(model.model)
    if isinstance(model, PartitionedTarget):
        return {"full": full, "resident": model.resident_bytes(), "shared": model.shared_bytes(),
                "gathered": model.gathered_peak_bytes()}
    return {"full": full, "resident": full, "shared": 0, "gathered": 0}


def target_summary(memory: dict, world_size: int, *, features: str | None, partition: str, offload: bool,
                   decodes: bool) -> str:
    """The run header's line on where the target lives (`memory`: `target_bytes`), by the run's
    --features, --target-partition, --target-offload and whether it decodes held-out turns at the end."""
    if features:
        return (f"target: its features read from --features {features}; in memory only the embedding "
                f"and lm_head the drafter borrows, {gib(memory['full'])}")
    if partition == "none":
        return f"target: a full copy on every rank, {gib(memory['full'])}"
    where = "in CPU memory (--target-offload)" if offload else "on the device"
    skipped = " Held-out decoding at the end is skipped (it needs the whole target on one device: run " \
              "launch/speculate.py with the exported drafter)." if decodes else ""
    return (f"target: ZeRO-3 partitioned over {world_size} rank(s), {gib(memory['resident'])} per rank {where} of "
            f"{gib(memory['full'])}, plus the embedding and lm_head replicated for the drafter "
            f"({gib(memory['shared'])}); each layer is gathered as it runs.{skipped}")
