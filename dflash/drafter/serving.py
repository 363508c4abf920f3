"""What a drafter's config.json states for the serving engines, so that none of them falls back to a
default of its own: they read these fields as follows (read from their code, docs/ARCHITECTURE.md).

- Causality, vLLM (`qwen3_dflash.py` `_dflash_layer_causal`): the top-level `is_causal`, else
  `dflash_config.causal`, else the layer's type (sliding: causal). SGLang (`models/dflash.py`):
  `is_causal`, else the layer's type. Where every layer computes one causality, both keys say it;
  layers of mixed causality are left to the layer types, on which the engines agree.
- Sliding window, vLLM (`_resolve_layer_attention`): `layer_types[i]`, unless `dflash_config.use_swa`
  (every layer sliding when none is), window `dflash_config.swa_window_size`, else `sliding_window`;
  SGLang: `layer_types[i]`, window `sliding_window` (less the query's own position).
- RoPE style: vLLM `is_neox_style`, SGLang `rope_is_neox_style`, else `is_neox_style`; both default
  to the rotate-half (neox) style this drafter computes, which the export says rather than relies on.
- vLLM's attention sink: `dflash_config.attention_sink_bias`, else `add_swa_attention_sink_bias`.
- A drafter kind's own settings: every key in `dflash_config` (its `write_config`), a setting of none
  as null.
"""
from __future__ import annotations

from typing import Any

from dflash.drafter.config_format import SLIDING

# Top-level keys written besides the official format's (`CONFIG_KEYS`); `is_causal` only when one
# causality holds for every layer (`OPTIONAL_CONFIG_KEYS`).
ROPE_STYLE_KEYS = ("is_neox_style", "rope_is_neox_style")


def layer_causality(config) -> set[bool]:
    """The causalities the drafter's layers compute (`DrafterConfig.layer_attention`)."""
    return {config.layer_attention(i)[1] for i in range(config.num_hidden_layers)}


def state_serving_fields(out: dict[str, Any], config) -> dict[str, Any]:
    """`out` (the config.json content of `config`, a `DrafterConfig`) with every field above stated."""
    dflash = out["dflash_config"]
    causal = layer_causality(config)
    if len(causal) == 1:
        out["is_causal"] = dflash["causal"] = causal.pop()
    for key in ROPE_STYLE_KEYS:
        out[key] = True  # `drafter._rotate_half`: the two halves of each head rotate together
    dflash["use_swa"] = False  # the layer types say which layers slide
    if SLIDING in config.layer_types:
        dflash["swa_window_size"] = config.sliding_window
    dflash["attention_sink_bias"] = False
    return out
