"""The memory plan: the bytes one rank needs for a training run, before anything loads.

    peak = static + max(target phase, drafter phase)

static: the target's parameters (a full copy; or 1/W of them, the small ones kept gathered,
two layers gathered at once, and the drafter's replicated embedding and lm_head when
partitioned), the drafter's weights, gradients and AdamW state as the ZeRO stage splits them,
and DeepSpeed's bucket buffers. The target phase is its feature forward of one micro-batch
(no grad: one layer's intermediates and the tapped states per token); the drafter phase is its
forward and backward: per token the features, the fused context and every layer's context keys
and values; per block row (block size x anchors of every sample) every layer's saved
activations, and the larger of the loss's lm_head chunk and one layer's backward buffers.

The coefficients count what each op saves for backward in this code (`dflash.drafter.network`,
RMSNorm in fp32, the block attention's Triton kernels) at the training dtype; the estimate is
checked against measured peaks of CPU runs (`launch/plan_memory.py --measure`, docs/BENCHMARKS.md).
On top of the peak, a GPU loses memory the tensors never see (CUDA context, NCCL buffers,
allocator fragmentation): `RESERVE_FRACTION` of the memory and `RESERVE_BYTES` are kept free.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from dflash.drafter.kinds import DEFAULT, drafter_kind
from dflash.errors import UserError
from dflash.objective.anchors import DEFAULT_NUM_ANCHORS
from dflash.objective.loss import DEFAULT_CHUNK_ROWS
from dflash.sizing import reference_attention
from dflash.target.spec import TargetSpec

GIB = 2**30
RESERVE_BYTES = 2 * GIB  # CUDA context, NCCL and DeepSpeed communication buffers
RESERVE_FRACTION = 0.05  # allocator fragmentation

@dataclass(frozen=True)
class TargetSizes:
    """Parameter counts of a target, from transformers' own model class built on the meta device."""

    params: int  # all parameters
    largest_layer: int  # the largest decoder layer
    largest_tensor: int  # the largest parameter tensor of a decoder layer
    small: int  # tensors of at most hidden-size elements (norms, biases: kept gathered when partitioned)
    embed: int  # embedding rows x hidden
    lm_head: int  # 0 when tied to the embedding
    hidden: int
    mlp_width: int  # outputs per token of the widest MLP's projections (MoE: the routed experts' and shared)
    mixer_width: int  # outputs per token of the widest attention / linear-attention block's projections
    vocab: int
    head_dim: int  # width of the RoPE tables


def _layer_width(layer, top_k: int) -> int:
    """Output elements per token of a layer's projections; expert tensors (experts x out x in)
    count top_k experts, as routing sends each token to that many."""
    width = 0
    for module in layer.modules():
        for p in module.parameters(recurse=False):
            if p.dim() == 2:
                width += p.shape[0]
            elif p.dim() == 3:
                width += top_k * p.shape[1]
    return width


def target_sizes(config) -> TargetSizes:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as e:
        raise UserError(f"target {config.model_type}: transformers cannot build it to count its parameters ({e})") \
            from None
    hidden = int(config.hidden_size)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    layers = model.base_model.layers
    top_k = int(getattr(config, "num_experts_per_tok", 1) or 1)
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    return TargetSizes(
        params=sum(p.numel() for p in model.parameters()),
        largest_layer=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
        largest_tensor=max(p.numel() for layer in layers for p in layer.parameters()),
        small=sum(p.numel() for p in model.parameters() if p.numel() <= hidden),
        embed=embed.numel(), lm_head=0 if head is embed else head.numel(), hidden=hidden,
        mlp_width=max(_layer_width(m, top_k) if m is not None else 0 for m in mlps),
        mixer_width=max(_layer_width(layer, top_k) - (_layer_width(m, top_k) if m is not None else 0)
                        for layer, m in zip(layers, mlps, strict=True)), vocab=int(embed.shape[0]),
        head_dim=int(getattr(config, "head_dim", None) or hidden // config.num_attention_heads))


@dataclass(frozen=True)
class DrafterSizes:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    features: int  # tapped target layers
    vocab: int = 0  # the target's vocabulary (the drafter's logits; a kind's parts over it, `head_params`)
    # the drafter's kind (`--drafter-kind`) and its settings (`DrafterConfig.kind_settings`): what the kind's
    # own parts add, it prices (`DrafterKind`'s costs)
    kind: str = DEFAULT
    kind_settings: Any = None
    block_size: int = 16  # the anchor and its drafted slots: a kind's parts may be sized per slot

    @classmethod
    def from_target(cls, config, *, layers: int, features: int, kind: str = DEFAULT,
                    kind_settings: Any = None, block_size: int = 16) -> DrafterSizes:
        """The drafter DFlash builds for `config` (its hidden size, heads and MLP width; an MoE
        target without a dense width: its routed experts' width per token), of the drafter kind
        `kind` with its settings `kind_settings`."""
        heads = int(config.num_attention_heads)
        width = getattr(config, "intermediate_size", None) or \
            int(config.num_experts_per_tok) * int(config.moe_intermediate_size)
        return cls(hidden=int(config.hidden_size), intermediate=int(width), heads=heads,
                   kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
                   layers=layers, features=features, vocab=int(config.vocab_size), kind=kind,
                   kind_settings=kind_settings, block_size=block_size)

    @property
    def drafter_kind(self):
        """The `DrafterKind` that prices its own parts."""
        return drafter_kind(self.kind)

    @property
    def layer_params(self) -> int:
        H, D = self.hidden, self.head_dim
        return (2 * H * self.heads * D + 2 * H * self.kv_heads * D + 3 * H * self.intermediate + 2 * H + 2 * D
                + self.drafter_kind.layer_params(self.kind_settings, self))

    @property
    def params(self) -> int:
        return (self.features * self.hidden * self.hidden + self.layers * self.layer_params + 2 * self.hidden
                + self.drafter_kind.head_params(self.kind_settings, self))


@dataclass(frozen=True)
class MemorySetup:
    """What the run looks like: ranks, precision, ZeRO stage and offloads, drafter options."""

    world_size: int = 1
    dtype_bytes: int = 2  # bf16 (2) or fp32 (4): target, drafter and activations alike
    zero_stage: int = 2
    bucket_elements: int = 0  # ZeRO-1/2 reduce + allgather bucket elements
    offload_optimizer: bool = False
    offload_param: bool = False  # the drafter's parameters (ZeRO-3 offload_param)
    target_partition: str = "none"
    target_offload: bool = False
    activation_checkpointing: bool = False
    block_size: int = 16
    num_anchors: int = DEFAULT_NUM_ANCHORS
    # the drafter's block attention: "kernel" (Triton or FlexAttention: output and log-sum-exp saved) or
    # "reference" (dflash.ops' per-sample torch reference, the CPU's: its scores saved, per row and key)
    attention: str = "kernel"
    # the objective (`BlockLoss.vocab_buffers`, `loss_setup`): fp32 chunk x vocab buffers of one lm_head
    # chunk at once, the chunk's rows, and whether its terms read the target's final states (KL, LK)
    vocab_buffers: int = 1
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    target_states: bool = False

    @classmethod
    def from_ds_config(cls, ds_config: dict, **kwargs) -> MemorySetup:
        zero = ds_config.get("zero_optimization", {})
        stage = int(zero.get("stage", 0))
        buckets = 0
        if stage in (1, 2):
            buckets = int(zero.get("reduce_bucket_size", 5e8)) + int(zero.get("allgather_bucket_size", 5e8))

        def offloaded(key):
            return zero.get(key, {}).get("device", "none") not in ("none", None)

        return cls(zero_stage=stage, bucket_elements=buckets, offload_optimizer=offloaded("offload_optimizer"),
                   offload_param=offloaded("offload_param"), **kwargs)


class MemoryPlan:
    """Bytes per rank of a run: `static()` items, and `peak(tokens, rows)` of a micro-batch of
    `tokens` tokens and `rows` drafter block rows (what the planner's budgets cap)."""

    def __init__(self, target: TargetSizes, drafter: DrafterSizes, setup: MemorySetup):
        self.target, self.drafter, self.setup = target, drafter, setup

    # ---- static ---------------------------------------------------------------------------
    def target_items(self) -> dict:
        t, s, b = self.target, self.setup, self.setup.dtype_bytes
        if s.target_partition == "none":
            return {"target (a full copy)": t.params * b}
        items = {"target partition (1/W)": math.ceil(t.params / s.world_size) * b,
                 "target norms and biases (kept gathered)": t.small * b,
                 "embedding and lm_head copies for the drafter": (t.embed + t.lm_head) * b}
        if s.target_offload:
            items["target partition (1/W)"] = 0  # in host memory
        return items

    def drafter_items(self) -> dict:
        d, s, b, W = self.drafter, self.setup, self.setup.dtype_bytes, self.setup.world_size
        P = d.params
        state = 0 if s.offload_optimizer else math.ceil(P / W) * 12  # fp32 master copy, AdamW moments
        if s.zero_stage == 3:
            weights = 0 if s.offload_param else math.ceil(P / W) * b
            return {"drafter weights (1/W) and a gathered layer": weights + 2 * d.layer_params * b,
                    "drafter gradients (1/W)": math.ceil(P / W) * b, "drafter optimizer state": state}
        # the micro-batches of a step accumulate: the full gradients of the last backward beside the
        # reduced partition, and the reduce and all-gather buckets
        grads = P * b + math.ceil(P / W) * b
        return {"drafter weights": P * b, "drafter gradients": grads + s.bucket_elements * b,
                "drafter optimizer state": state}

    def backward_gradients(self) -> int:
        """Gradient bytes a backward allocates as it goes (ZeRO 0-2: the full gradients and the buckets,
        freed by the step; under ZeRO-3 counted as none)."""
        d, s = self.drafter, self.setup
        return 0 if s.zero_stage == 3 else (d.params + s.bucket_elements) * s.dtype_bytes

    def static(self) -> dict:
        return {**self.target_items(), **self.drafter_items()}

    def host_bytes(self) -> int:
        """What the offloads keep in host memory per rank."""
        t, d, s, b = self.target, self.drafter, self.setup, self.setup.dtype_bytes
        host = math.ceil(t.params / s.world_size) * b if s.target_partition == "zero3" and s.target_offload else 0
        if s.offload_optimizer:
            host += math.ceil(d.params / s.world_size) * 12
        if s.offload_param and s.zero_stage == 3:
            host += math.ceil(d.params / s.world_size) * b
        return host

    # ---- per micro-batch ------------------------------------------------------------------
    def gathered(self) -> int:
        """Target parameters gathered at once while the features run (partitioned), released
        before the drafter runs: the embedding alone, or two layers (the running one and the
        prefetched next; the prefetch stops past that limit, one tensor over at most)."""
        t = self.target
        if self.setup.target_partition == "none":
            return 0
        return max(t.embed, 2 * t.largest_layer + t.largest_tensor) * self.setup.dtype_bytes

    def target_phase(self, tokens: int) -> int:
        """The feature forward (no grad), with the gathered layers when partitioned. Per token: the
        tapped states, the layer's input, residual and normed states, the RoPE tables and ids, and
        the larger of the MLP's intermediates (1.5x its projection outputs: gate, up and their
        product alive at once) and the attention's (2x its projection outputs: projections, fp32
        q/k norms, RoPE). Against measured peaks of single layers (docs/BENCHMARKS.md): +2..+27% in
        bf16, up to +55% in fp32 when attention dominates (tiny MLPs); the drafter phase usually
        dominates."""
        t, K, b = self.target, self.drafter.features, self.setup.dtype_bytes
        inside = max(1.5 * b * t.mlp_width, 2 * b * t.mixer_width)
        return int(tokens * ((K + 4) * b * t.hidden + inside + 2 * t.head_dim * b + 16)) + self.gathered()

    def per_token(self) -> int:
        """Drafter phase, per context token: the features, the fused context (fc output, its
        RMSNorm's saved tensors, the context every layer projects) and every layer's context keys
        (projection, k_norm, RoPE) and values, and the context's RoPE tables."""
        d, b = self.drafter, self.setup.dtype_bytes
        kv = d.kv_heads * d.head_dim
        layer = (4 + 3 * b) * kv + 4 * d.kv_heads
        kept = 0 if self.setup.activation_checkpointing else d.layers * layer
        return d.features * d.hidden * b + (4 + 2 * b) * d.hidden + 4 + 2 * d.head_dim * b + 16 + kept

    def layer_per_row(self) -> int:
        """What one drafter layer saves for backward per block row: two RMSNorms feeding
        projections (fp32 input, normed, output), queries and block keys (projection, norm, RoPE),
        block values, the attention output and its log-sum-exp, and the MLP's gate, activation, up
        and product; and what the kind's own parts of a layer save (`DrafterKind.layer_row_bytes`)."""
        d, b = self.drafter, self.setup.dtype_bytes
        q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
        norms = 2 * ((4 + 2 * b) * d.hidden + 4)
        attention = (4 + 3 * b) * q + 8 * d.heads + (4 + 3 * b) * kv + 4 * d.kv_heads
        own = d.drafter_kind.layer_row_bytes(d.kind_settings, d, self.setup)
        return norms + attention + 4 * b * d.intermediate + own

    def per_row(self) -> int:
        """Drafter phase, per block row: every layer's saved activations (only its input with
        activation checkpointing; the first layer's input, the embedding, needs no gradient), the
        final norm, the loss's saved gradient, the blocks' RoPE tables, ids, labels and weights."""
        d, s, b = self.drafter, self.setup, self.setup.dtype_bytes
        if s.activation_checkpointing:
            layers = d.layers * d.hidden * b
        else:
            layers = d.layers * self.layer_per_row() - 4 * d.hidden
        scored = (s.block_size - 1) / s.block_size
        return int(layers + (4 + b) * d.hidden + 4 + scored * d.hidden * b + 2 * d.head_dim * b + 48)

    def transient(self, tokens: int, rows: int, row_keys: int | None = None) -> int:
        """At the end of the forward, in the loss: the final states and their scored rows, one
        lm_head chunk (logits, their fp32 softmax, the chunk's input gradient), the kind's own loss
        (`DrafterKind.loss_row_bytes`) and what a layer's backward of the kind holds per row beside
        (`DrafterKind.backward_row_bytes`); the backward frees saved activations as fast as it makes gradients, but
        the reference attention's backward (`reference_attention.backward_per_layer`) needs more than the
        layer freed before it (its MLP and second norm). With activation checkpointing, the backward's
        recomputed layer and its gradients instead, when larger. The chunked reference attention's chunk
        on top (counted as if it met the loss's buffers)."""
        d, s, b = self.drafter, self.setup, self.setup.dtype_bytes
        chunk = min(s.chunk_rows, rows)
        scored = rows * (s.block_size - 1) // s.block_size
        # the kind's own loss is freed before the backward reaches the layers; its backward runs first,
        # before any layer's gradient exists (ZeRO 0-2: in the place of the full gradients and buckets that
        # the layers' backward then fills, `drafter_items`), so only its excess over them counts
        own = max(0, rows * d.drafter_kind.loss_row_bytes(d.kind_settings, d, s) - self.backward_gradients())
        loss = (rows + scored + chunk) * d.hidden * b + own \
            + chunk * self.target.vocab * max(4 * s.vocab_buffers + (b if b < 4 else 0), b)  # (0: the logits alone)
        row_keys = rows * tokens if row_keys is None else row_keys
        in_flight = reference_attention.chunk_in_flight(d, s, row_keys) \
            + rows * d.drafter_kind.backward_row_bytes(d.kind_settings, d, s)
        # what a layer's backward frees before it reaches the attention: its MLP's and second norm's saved
        # tensors (and, recomputed, its MLP's gradients)
        freed = rows * (4 * b * d.intermediate + (4 + 2 * b) * d.hidden + 4)
        attention = reference_attention.backward_per_layer(d, s, rows, row_keys)
        if not s.activation_checkpointing:
            return max(loss, attention - freed) + in_flight
        kv = d.kv_heads * d.head_dim
        # the recomputed layer, its MLP's gradients, and the context's key, value and state gradients
        layer = rows * (self.layer_per_row() + b * (d.intermediate + d.hidden)) \
            + tokens * ((4 + 5 * b) * kv + 4 * d.kv_heads + b * d.hidden)
        return max(loss, layer + max(0, attention - freed - rows * b * (d.intermediate + d.hidden))) + in_flight

    def drafter_phase(self, tokens: int, rows: int, row_keys: int | None = None) -> int:
        """`row_keys`: the reference attention's pairs of one micro-batch, priced as it is. Without
        them, the most any micro-batch of `tokens` tokens and up to `rows` rows needs (what a row
        budget must bound): the reference runs in chunks past a number of scores and then holds less
        than just below it, so fewer rows can need more; this price is monotonic in rows."""
        if row_keys is not None:
            return self._drafter_phase(tokens, rows, row_keys)
        price = self._drafter_phase(tokens, rows, rows * tokens)
        below = reference_attention.unchunked_rows(self.drafter, self.setup, tokens)
        if below is not None and 0 < below < rows:
            price = max(price, self._drafter_phase(tokens, below, below * tokens))
        return price

    def _drafter_phase(self, tokens: int, rows: int, row_keys: int) -> int:
        reference = reference_attention.saved_per_layer(self.drafter, self.setup, rows, row_keys)
        layers = 1 if self.setup.activation_checkpointing else self.drafter.layers
        # KL and LK read the target's final states of every token (kept from its forward)
        states = tokens * self.target.hidden * self.setup.dtype_bytes if self.setup.target_states else 0
        d = self.drafter
        terms = (d.drafter_kind.term_bytes(d.kind_settings, d, self.setup)
                 + rows * d.drafter_kind.term_row_bytes(d.kind_settings, d, self.setup))
        return (tokens * self.per_token() + rows * self.per_row() + self.transient(tokens, rows, row_keys)
                + layers * reference + states + terms)

    def peak(self, tokens: int, rows: int, row_keys: int | None = None) -> dict:
        """Bytes at the peak of a micro-batch, by item; "total" sums them. `row_keys`: see drafter_phase."""
        items = dict(self.static())
        target, drafter = self.target_phase(tokens), self.drafter_phase(tokens, rows, row_keys)
        if target > drafter:
            items[f"target features forward of {tokens:,} tokens"] = target
        else:
            items[f"drafter forward and backward of {tokens:,} tokens, {rows:,} rows"] = drafter
        items["total"] = sum(items.values())
        return items

    # ---- what fits -------------------------------------------------------------------------
    @staticmethod
    def usable(memory: int) -> int:
        """Bytes the tensors may use of `memory` (the reserve kept free)."""
        return int(memory * (1 - RESERVE_FRACTION)) - RESERVE_BYTES

    def min_rows(self) -> int:
        """Every micro-batch must hold one sample's blocks: block size x anchors rows."""
        return self.setup.block_size * self.setup.num_anchors

    def rows_that_fit(self, memory: int, tokens: int) -> int:
        """The most block rows a micro-batch of `tokens` tokens may score (0: not even none)."""
        room = self.usable(memory) - sum(self.static().values())
        if room < self.target_phase(tokens) or room < self.drafter_phase(tokens, 0):
            return 0
        lo, hi = 0, 1
        while self.drafter_phase(tokens, hi) <= room:
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.drafter_phase(tokens, mid) <= room else (lo, mid)
        return lo

    def anchor_ceiling(self, memory: int, tokens: int) -> int:
        """The most anchors one sample of `tokens` tokens may have (a micro-batch of that sample
        alone, block size rows per anchor): what --num-anchors may be at that length (0: none)."""
        return self.rows_that_fit(memory, tokens) // self.setup.block_size

    def tokens_that_fit(self, memory: int, rows: int) -> int:
        """The largest token budget whose micro-batches fit with `rows` block rows (0: none)."""
        room = self.usable(memory) - sum(self.static().values())
        lo, hi = 0, 1

        def fits(tokens):
            return self.target_phase(tokens) <= room and self.drafter_phase(tokens, rows) <= room

        if not fits(1):
            return 0
        while fits(hi) and hi < 2**40:
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def to_dict(self) -> dict:
        return {"target": asdict(self.target), "drafter": asdict(self.drafter), "setup": asdict(self.setup)}

    def partitioned(self) -> MemoryPlan:
        return MemoryPlan(self.target, self.drafter, replace(self.setup, target_partition="zero3"))


def plan_for(spec: TargetSpec, setup: MemorySetup, *, draft_layers: int, features: int, kind: str = DEFAULT,
             kind_settings: Any = None) -> MemoryPlan:
    """The plan of a drafter of `kind` (its settings `kind_settings`) on the target `spec`."""
    config = spec.config
    drafter = DrafterSizes.from_target(config, layers=draft_layers, features=features, kind=kind,
                                       kind_settings=kind_settings, block_size=setup.block_size)
    return MemoryPlan(target_sizes(config), drafter, setup)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 4 else f"{n / 2**20:.2f} MiB"


def describe(items: dict) -> str:
    return "; ".join(f"{k} {gib(v)}" for k, v in items.items() if k != "total" and v)


def dumps(plan: MemoryPlan) -> str:
    return json.dumps(plan.to_dict())
