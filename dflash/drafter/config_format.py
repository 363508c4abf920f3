"""The official DFlash `config.json` format: its keys, layer types and architectures, and the refusal
of a config.json that the serving engines would serve differently or that asks for what this drafter
does not compute.

Layer types: `layer_types` (one of LAYER_TYPES per layer) and `sliding_window` decide each layer's
attention as vLLM and SGLang serve it (docs/ARCHITECTURE.md, "Drafter layer types as the engines
serve them"): full layers are bidirectional over the context, sliding layers causal within the
block and limited to the last `sliding_window` positions; a top-level `is_causal` overrides the
causality of every layer.
"""
from __future__ import annotations

from typing import Any

# The exact key set of the config.json written by `DrafterConfig.to_json_dict`.
CONFIG_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "dtype",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "max_position_embeddings",
        "vocab_size",
        "attention_bias",
        "attention_dropout",
        "initializer_range",
        "tie_word_embeddings",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
        "block_size",
        "num_target_layers",
        "dflash_config",
        "is_neox_style",  # the RoPE style, for vLLM and SGLang (`dflash.drafter.serving`)
        "rope_is_neox_style",
    }
)

# The target the drafter was trained on (its name as given, family, depth and content hash,
# `dflash.identity`), written by training's export: an extra top-level key, which transformers keeps
# as an attribute and the engines never read; `launch/speculate.py` takes the target from it.
TARGET_KEY = "dflash_target"

# Written when every layer computes one causality (`dflash.drafter.serving`): an `is_causal` key, even
# false, overrides every layer's default in the engines.
OPTIONAL_CONFIG_KEYS = frozenset({"is_causal"})

FULL, SLIDING = "full_attention", "sliding_attention"

LAYER_TYPES = (FULL, SLIDING)

# Config entries that change the drafter's computation in vLLM, SGLang or the official class and
# that this drafter does not implement: (where, key, the value that means "off").
_UNSUPPORTED = (
    ("dflash_config", "attention_sink_bias", False),
    ("top", "add_swa_attention_sink_bias", False),
    ("dflash_config", "attention_value_scale", None),
    ("top", "is_neox_style", True),
    ("top", "rope_is_neox_style", True),
    ("dflash_config", "use_aux_hidden_state", True),
    ("dflash_config", "sample_from_anchor", False),
    ("dflash_config", "input_embedding_scale", 1.0),
    ("dflash_config", "output_multiplier", 1.0),
    ("dflash_config", "final_logit_softcapping", None),
    ("dflash_config", "conv_kernel_size", 0),
    ("dflash_config", "selector_rank", 0),
)


def check_layer_types(layer_types, num_layers: int, sliding_window) -> list[str]:
    """The per-layer types, checked (default: all full_attention); sliding layers need a window."""
    if layer_types is None:
        layer_types = [FULL] * num_layers
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} drafter layers "
                         f"(one per layer): {layer_types}")
    bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if bad:
        raise ValueError(f"layer_types holds {bad}; each entry must be one of {list(LAYER_TYPES)}")
    if SLIDING in layer_types:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_attention layers need sliding_window, an integer >= 1; got {sliding_window!r}")
    elif sliding_window is not None:
        raise ValueError(f"sliding_window {sliding_window} is given but no layer is sliding_attention "
                         f"(layer_types {layer_types})")
    return layer_types


def check_engine_agreement(d: dict[str, Any]) -> None:
    """Refuse a config.json whose layers vLLM and SGLang would serve with different masks.

    vLLM alone reads `dflash_config.causal`, `use_swa` and `swa_window_size`
    (qwen3_dflash.py `_dflash_layer_causal`, `_resolve_layer_attention`); both read `layer_types`,
    `sliding_window` through transformers' Qwen3Config, which drops the window unless
    `use_sliding_window` is true (docs/ARCHITECTURE.md, "Drafter layer types").
    """
    dflash = d.get("dflash_config") or {}
    layer_types = d.get("layer_types") or []
    sliding = [t == SLIDING for t in layer_types]
    if any(sliding) and not d.get("use_sliding_window", False):
        raise ValueError("config.json has sliding_attention layers but use_sliding_window is not true: transformers' "
                         "Qwen3Config then drops sliding_window, and vLLM and SGLang refuse the drafter "
                         "(set \"use_sliding_window\": true)")
    causal = dflash.get("causal")
    if causal is not None and d.get("is_causal") is None and any(bool(causal) != s for s in sliding or [False]):
        raise ValueError(f"dflash_config.causal = {causal!r} is read by vLLM only: vLLM would serve "
                         f"{'causal' if causal else 'bidirectional'} layers where SGLang serves the per-type "
                         "default (full: bidirectional, sliding: causal); use the top-level is_causal, read by both")
    if dflash.get("use_swa") and not any(sliding):
        raise ValueError("dflash_config.use_swa is read by vLLM only: vLLM would serve every layer with a sliding "
                         "window where SGLang serves full attention; give layer_types and sliding_window instead")
    swa = dflash.get("swa_window_size")
    if swa is not None and any(sliding) and swa != d.get("sliding_window"):
        raise ValueError(f"dflash_config.swa_window_size = {swa} differs from sliding_window = "
                         f"{d.get('sliding_window')}: vLLM would serve the first, SGLang the second")


def check_supported(d: dict[str, Any], computed: tuple[str, ...] = ()) -> None:
    """Refuse a config.json that asks for what this drafter does not compute (naming the key);
    `computed`: the keys its drafter kind computes (`DrafterKind.config_keys`)."""
    dflash = d.get("dflash_config") or {}
    for where, key, off in _UNSUPPORTED:
        if key in computed:
            continue
        value = (dflash if where == "dflash_config" else d).get(key, off)
        if value != off and not (off is None and not value):
            name = f"dflash_config.{key}" if where == "dflash_config" else key
            raise ValueError(f"config.json sets {name} = {value!r}, which this drafter does not implement "
                             f"(supported: {off!r})")
    for key, ref in (("target_hidden_size", "hidden_size"), ("draft_vocab_size", "vocab_size")):
        if d.get(key) is not None and d[key] != d.get(ref):
            raise ValueError(f"config.json sets {key} = {d[key]} != {ref} = {d.get(ref)}, which this drafter "
                             "does not implement")

