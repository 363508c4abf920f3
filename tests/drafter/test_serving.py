"""The export states every field a serving engine reads, so that no engine falls back to a default of
its own: each config.json is read here with the engines' resolution rules (written from their code:
vLLM `vllm/model_executor/models/qwen3_dflash.py` `_dflash_layer_causal`, `_resolve_layer_attention`
and the layer's `is_neox_style`; SGLang `python/sglang/srt/models/dflash.py` layer attention and
rotary embedding; the official DFlash2 class's dflash_config-first reads; docs/ARCHITECTURE.md
cites the lines), once with the engines' own defaults and once with every default turned
against us: both must give what the drafter computes."""
import json

import pytest

from dflash.drafter.config_format import FULL, SLIDING
from dflash.drafter.kinds.dflash2 import DFlash2Settings
from dflash.models import DrafterConfig

from .checkpoint_helpers import MASK_ID, make_drafter, target_config

# each engine's defaults for the fields it may find missing, and the opposite of each
DEFAULTS = {"is_neox_style": True, "use_swa": False, "attention_sink_bias": False, "window": None,
            "softcap": None, "input_embedding_scale": 1.0, "output_multiplier": 1.0}
HOSTILE = {"is_neox_style": False, "use_swa": True, "attention_sink_bias": True, "window": 99,
           "softcap": 30.0, "input_embedding_scale": 2.0, "output_multiplier": 3.0}


def vllm_layer(c: dict, i: int, defaults: dict) -> tuple:
    """(window, causal, neox, sink) of layer i as vLLM's DFlash model resolves them."""
    dflash = c.get("dflash_config") or {}
    if c.get("is_causal") is not None:
        causal = bool(c["is_causal"])
    elif dflash.get("causal") is not None:
        causal = bool(dflash["causal"])
    else:
        causal = bool(c.get("layer_types")) and c["layer_types"][i] == SLIDING
    types, use_swa = c.get("layer_types"), dflash.get("use_swa", defaults["use_swa"])
    any_sliding = bool(types) and SLIDING in types
    sliding = use_swa if types is None or (use_swa and not any_sliding) else types[i] == SLIDING
    window = dflash.get("swa_window_size", c.get("sliding_window", defaults["window"])) if sliding else None
    sink = dflash.get("attention_sink_bias", c.get("add_swa_attention_sink_bias", defaults["attention_sink_bias"]))
    return window, causal, c.get("is_neox_style", defaults["is_neox_style"]), sink


def sglang_layer(c: dict, i: int, defaults: dict) -> tuple:
    """(window, causal, neox) of layer i as SGLang's DFlash model resolves them: a full layer
    ENCODER_ONLY, a sliding one DECODER with window_left = sliding_window - 1, the top-level
    is_causal overriding (SGLang 0.5.23, docs/ARCHITECTURE.md; dflash_config.causal is vLLM's alone)."""
    types = c.get("layer_types")
    sliding = bool(types) and types[i] == SLIDING
    window = c.get("sliding_window", defaults["window"]) if sliding else None
    causal = sliding if c.get("is_causal") is None else bool(c["is_causal"])
    neox = c.get("rope_is_neox_style", c.get("is_neox_style", defaults["is_neox_style"]))
    return window, causal, neox


def dflash2_settings(c: dict, defaults: dict) -> tuple:
    """The official DFlash2 class's reads: dflash_config first, then the top level, then its default."""
    dflash = c["dflash_config"]

    def pick(key, default):
        return dflash.get(key, c.get(key, default))
    return (pick("final_logit_softcapping", defaults["softcap"]), pick("input_embedding_scale",
                                                                       defaults["input_embedding_scale"]),
            pick("output_multiplier", defaults["output_multiplier"]))


S, F = SLIDING, FULL


@pytest.mark.parametrize("defaults", [DEFAULTS, HOSTILE], ids=["engine defaults", "every default against us"])
def test_a_dflash2_export_states_the_settings_the_official_class_reads(defaults):
    """Every layer's attention as the engines read it, of every drafter kind: tests/drafter/test_kind_conformance.py;
    here DFlash2's own settings, as released (all sliding, not causal) and away from the defaults."""
    config = DrafterConfig.from_target(target_config(), mask_token_id=MASK_ID, block_size=16, draft_layers=3,
                                       target_layer_ids=[1, 3, 6], layer_types=[S, S, S], sliding_window=2048,
                                       is_causal=False, kind="dflash2", kind_settings=DFlash2Settings(
                                           conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4,
                                           output_multiplier=0.5, final_logit_softcapping=8.0,
                                           input_embedding_scale=1.5))
    exported = json.loads(json.dumps(config.to_json_dict()))  # as a file holds it
    s = config.kind_settings
    assert dflash2_settings(exported, defaults) == (s.final_logit_softcapping, s.input_embedding_scale,
                                                    s.output_multiplier)
    default = DrafterConfig.from_json_dict({**exported, "dflash_config": {
        **exported["dflash_config"], "final_logit_softcapping": None, "input_embedding_scale": 1.0,
        "output_multiplier": 1.0}})
    exported = json.loads(json.dumps(default.to_json_dict()))
    assert dflash2_settings(exported, defaults) == (None, 1.0, 1.0), "the defaults stated too"


def test_the_saved_config_is_the_stated_one(tmp_path):
    drafter = make_drafter(layer_types=[S, S, F], sliding_window=6)
    drafter.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved == {**json.loads(json.dumps(drafter.config.to_json_dict())), "dtype": "float32"}
    assert "is_causal" not in saved, "mixed causality: the layer types state it, on which the engines agree"
    assert saved["dflash_config"]["swa_window_size"] == saved["sliding_window"] == 6
