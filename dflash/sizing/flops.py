"""Cost counters: matmul FLOPs of the target feature forward (layers 0..max tap, no
lm_head), and peak tensor memory of any function.

Counted the way `torch.utils.flop_counter.FlopCounterMode` counts a forward: 2*M*N*K per
matmul, and attention as dense per-sample QK^T and PV (4 * n^2 * Hq * D per layer for a
sequence of n rows; a kernel that skips the masked half of a causal tile does about half).
Norms, RoPE, softmax and activations are not matmuls and are not counted.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

from dflash.drafter.config import drafter_intermediate_size
from dflash.errors import UserError
from dflash.target.spec import PRESETS, load_target_spec, missing_sizes, read_config_json


def load_target_config(model: str):
    """The sizes the cost model prices: a preset of `dflash.target.spec.PRESETS` (e.g.
    "qwen3-8b") or the path of a target's config.json (or its folder); only the sizes are read,
    so a config of any model_type will do."""
    if model in PRESETS:
        return load_target_spec(model, "--model", bare_presets=True).config
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UserError(f"--model {model}: neither a preset ({', '.join(PRESETS)}) nor a config.json")
    fields = read_config_json(path)
    missing = missing_sizes(fields)
    if missing:
        raise UserError(f"{path}: missing {', '.join(missing)}; the cost model needs the model's sizes")
    return SimpleNamespace(**fields)


def _get(config, *names, default=None):
    """The first of `names` the config has (not None): config.json keys and transformers' attribute names differ."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def layer_types(config) -> list[str]:
    """"full_attention", "sliding_attention" or "linear_attention" for every decoder layer."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    # Llama/Mistral-style configs: one kind for all layers, sliding when a window is set
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


def _attention(config) -> tuple[int, int, int]:
    """(Hq, query/key head dim, value head dim); MLA's qk = nope + rope dims, v its own."""
    hq = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None):  # multi-head latent attention
        return hq, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    d = _get(config, "head_dim", default=config.hidden_size // hq)
    return hq, d, d


def _attention_projections(config) -> int:
    """Linear FLOPs per token of an attention layer's projections."""
    h = config.hidden_size
    hq, dqk, dv = _attention(config)
    if getattr(config, "kv_lora_rank", None):  # MLA: low-rank q, compressed kv expanded per head
        q_rank = getattr(config, "q_lora_rank", None)
        q = 2 * h * q_rank + 2 * q_rank * hq * dqk if q_rank else 2 * h * hq * dqk
        kv = 2 * h * (config.kv_lora_rank + config.qk_rope_head_dim) + \
            2 * config.kv_lora_rank * hq * (config.qk_nope_head_dim + dv)
        return q + kv + 2 * hq * dv * h
    hkv = _get(config, "num_key_value_heads", default=hq)
    gate = 2 if str(getattr(config, "model_type", "")).startswith(("qwen3_5", "qwen3_next")) else 1  # gated output
    return 2 * h * (gate * hq * dqk + 2 * hkv * dqk) + 2 * hq * dqk * h


# Chunk length of the chunked delta rule (flash-linear-attention's and transformers' kernels).
DELTA_RULE_CHUNK = 64


def _linear_attention(config) -> int:
    """FLOPs per token of a Gated DeltaNet token mixer: projections, the short convolution, and the
    chunked delta rule's matmuls per value head (chunk C: 4 C Dk + 2 C Dv within the chunk, and
    6 Dk Dv against the state; its small triangular solves are not counted)."""
    h = config.hidden_size
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    key, value = hk * dk, hv * dv
    conv = 2 * key + value
    c = DELTA_RULE_CHUNK
    projections = 2 * h * (conv + value + 2 * hv) + 2 * value * h
    return projections + 2 * config.linear_conv_kernel_dim * conv + hv * (4 * c * dk + 2 * c * dv + 6 * dk * dv)


def _is_moe_layer(config, i: int) -> bool:
    experts = _get(config, "num_local_experts", "num_experts", "n_routed_experts", default=0)
    if not experts or not _get(config, "num_experts_per_tok"):
        return False
    if i in (getattr(config, "mlp_only_layers", None) or []):
        return False
    if i < (getattr(config, "first_k_dense_replace", None) or 0):
        return False
    step = getattr(config, "decoder_sparse_step", None) or 1
    return (i + 1) % step == 0


def _mlp(config, i: int) -> int:
    """FLOPs per token of layer i's MLP: the dense SwiGLU, or for MoE the router, the experts a token
    is routed to (active parameters) and the shared experts."""
    h = config.hidden_size
    if not _is_moe_layer(config, i):
        return 3 * 2 * h * config.intermediate_size
    experts = _get(config, "num_local_experts", "num_experts", "n_routed_experts")
    per_expert = _get(config, "moe_intermediate_size", "intermediate_size")
    flops = 2 * h * experts + config.num_experts_per_tok * 3 * 2 * h * per_expert
    shared = _get(config, "shared_expert_intermediate_size", default=0)
    if shared:  # Qwen3.5 MoE: one shared expert behind a sigmoid gate
        flops += 3 * 2 * h * shared + 2 * h
    flops += (getattr(config, "n_shared_experts", None) or 0) * 3 * 2 * h * per_expert  # DeepSeek-V3
    return flops


def layer_costs(config) -> list[tuple[int, int, int]]:
    """Per decoder layer: (FLOPs per token, FLOPs per query-key pair, sliding window or 0).

    Pairs: 2 Hq (Dqk + Dv) for QK^T and PV; 0 for a linear-attention layer (its cost is per token)."""
    hq, dqk, dv = _attention(config)
    pair = 2 * hq * (dqk + dv)
    window = getattr(config, "sliding_window", None) or 0
    out = []
    for i, kind in enumerate(layer_types(config)):
        if kind == "linear_attention":
            out.append((_linear_attention(config) + _mlp(config, i), 0, 0))
        else:
            out.append((_attention_projections(config) + _mlp(config, i), pair,
                        window if kind == "sliding_attention" else 0))
    return out


def _per_layer(config) -> tuple[int, int]:
    """(linear FLOPs per token, attention FLOPs per query-key pair) of one dense decoder layer: the
    drafter's (its layers are sized like the target's dense layers)."""
    H = config.hidden_size
    Hq = config.num_attention_heads
    Hkv = getattr(config, "num_key_value_heads", None) or Hq
    D = getattr(config, "head_dim", None) or H // Hq
    linear = 2 * H * (Hq * D + 2 * Hkv * D) + 2 * Hq * D * H + 3 * 2 * H * drafter_intermediate_size(config)
    return linear, 4 * Hq * D


def target_forward_flops(config, lengths: Sequence[int], num_layers: int, layout: str = "packed") -> int:
    """FLOPs of a feature forward through `num_layers` layers over one micro-batch.

    Args:
        config: the target's Hugging Face config (sizes only).
        lengths: the samples' token counts.
        num_layers: layers run (max(target_layer_ids) + 1).
        layout: "packed" (real tokens only, attention inside each sample) or "padded"
            (every sample padded to the longest: count x longest tokens, longest^2 pairs each).

    Attention counts n^2 pairs per sample in a full layer (dense, as FlopCounterMode counts
    SDPA) and `window_pairs(n, W)` in a sliding one (n^2 up to the window, then linear in n);
    linear-attention and MoE layers cost per token (`layer_costs`).
    """
    from dflash.data.cost import window_pairs

    lengths = [int(n) for n in lengths]
    if layout == "packed":
        seqs = lengths
    elif layout == "padded":
        seqs = [max(lengths, default=0)] * len(lengths)
    else:
        raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
    tokens, pairs = sum(seqs), sum(n * n for n in seqs)
    total = 0
    for linear, pair, window in layer_costs(config)[:num_layers]:
        total += tokens * linear + pair * (int(window_pairs(seqs, window).sum()) if window else pairs)
    return total


def _fused_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    b, hq, s_q, d = query_shape
    return 2 * b * hq * s_q * key_shape[-2] * (d + value_shape[-1])  # QK^T and PV


def _addmm_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def measure_flops(fn, *args, **kwargs) -> tuple[int, object]:
    """Run fn(*args, **kwargs) under FlopCounterMode; returns (matmul FLOPs, fn's result).

    The CPU's fused SDPA kernel and the in-place addmm_ (a gradient accumulated into a buffer) have no
    formula in torch's counter (they would count 0); they are counted here like the other SDPA kernels,
    dense over query x key, and like addmm.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _fused_sdpa_flops,
               torch.ops.aten.addmm_: _addmm_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        result = fn(*args, **kwargs)
    return counter.get_total_flops(), result


def flop_cost_model(target, *, num_target_layers: int, draft_layers: int = 5, num_features: int = 5,
                    block_size: int = 16, extra_row_flops: float = 0.0):
    """FLOP cost model of one training sample (`dflash.data.cost.CostModel`, unit FLOP).

    Target, frozen, forward only through `num_target_layers` layers (`layer_costs`): per token
    its projections, MLPs (MoE: active experts only) and linear-attention layers; per pair its
    causal attention, n^2/2 pairs per sample in full layers, window_pairs(n, W)/2 in sliding ones.
    Drafter (its layers sized like the target's dense layers, as DFlash builds it), per block row:
    its layers forward and backward (3x a forward) and the frozen lm_head forward plus the
    gradient of its input (2x); per context token: the feature projection (num_features x hidden
    -> hidden) and every layer's K/V projections, trained (3x); per row x context token: block
    attention to the context, about n/2 keys per row when anchors are spread over the sample (3x).
    A drafter kind's own parts add `extra_row_flops` per block row (`DrafterKind.row_flops`).
    """
    from dflash.data.cost import CostModel

    linear, pair = _per_layer(target)
    H = target.hidden_size
    Hq = target.num_attention_heads
    Hkv = getattr(target, "num_key_value_heads", None) or Hq
    D = getattr(target, "head_dim", None) or H // Hq
    per_row = 3 * draft_layers * linear + 2 * 2 * H * target.vocab_size
    per_row += extra_row_flops
    context = 3 * (2 * num_features * H * H + draft_layers * 2 * H * 2 * Hkv * D)
    layers = layer_costs(target)[:num_target_layers]
    windows = {w for _, _, w in layers if w}
    if len(windows) > 1:
        raise UserError(f"the target's sliding layers have different windows {sorted(windows)}; the cost model "
                        f"takes one")
    return CostModel(
        per_token=float(sum(t for t, _, _ in layers) + context),
        per_pair=float(sum(p for _, p, w in layers if not w) / 2),
        per_row=float(per_row),
        per_row_key=float(3 * draft_layers * pair / 2),
        per_window_pair=float(sum(p for _, p, w in layers if w) / 2),
        unit="FLOP",
        window=windows.pop() if windows else 0,
    )
