"""The official DFlash checkpoint format: exact tensor names, config keys, round trips."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, Qwen3Config

from dflash.drafter.config_format import OPTIONAL_CONFIG_KEYS
from dflash.models import CONFIG_KEYS, Anchors, DFlashDrafter, DrafterConfig
from dflash.target.model import SharedWeights

from .checkpoint_helpers import HEAD_DIM, HEADS, INTER, KV, MASK_ID, VOCAB, H, expected_names, make_drafter
from .official import official_dflash

S, F = "sliding_attention", "full_attention"


def test_tensor_names_and_shapes_are_exactly_the_official_set(tmp_path):
    make_drafter().save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
    assert names == expected_names(3)
    assert shapes["fc.weight"] == (H, 3 * H)
    assert shapes["layers.2.self_attn.q_proj.weight"] == (HEADS * HEAD_DIM, H)
    assert shapes["layers.2.self_attn.k_proj.weight"] == (KV * HEAD_DIM, H)
    assert shapes["layers.0.self_attn.q_norm.weight"] == (HEAD_DIM,)
    assert shapes["layers.1.mlp.down_proj.weight"] == (H, INTER)


def test_config_keys_and_values(tmp_path):
    make_drafter().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(config) == CONFIG_KEYS | {"is_causal"}  # every layer full: one causality, stated
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["head_dim"] == HEAD_DIM
    assert config["block_size"] == 16 and config["num_target_layers"] == 8
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3, 6], "causal": False,
                                       "use_swa": False, "attention_sink_bias": False}
    assert config["is_causal"] is False and config["is_neox_style"] is config["rope_is_neox_style"] is True
    assert config["layer_types"] == ["full_attention"] * 3 and config["num_hidden_layers"] == 3
    assert config["hidden_act"] == "silu" and config["rope_theta"] == 5e5 and config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 512 and config["tie_word_embeddings"] is False
    assert config["dtype"] == "float32" and config["vocab_size"] == VOCAB


def test_config_reads_back_as_the_same_qwen3_config(tmp_path):
    """Serving code builds the drafter's layers from a transformers Qwen3Config of this file."""
    make_drafter().save_pretrained(tmp_path)
    hf = Qwen3Config.from_pretrained(tmp_path)
    assert (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (H, HEADS, KV, HEAD_DIM)
    assert hf.intermediate_size == INTER and hf.num_hidden_layers == 3 and hf.rms_norm_eps == 1e-5
    assert hf.rope_parameters["rope_theta"] == 5e5 and hf.rope_parameters["rope_type"] == "default"
    assert hf.dflash_config["target_layer_ids"] == [1, 3, 6]


def test_scaled_rope_round_trips(tmp_path):
    llama = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=8,
                        num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=4096,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 1024})
    config = DrafterConfig.from_target(llama, mask_token_id=MASK_ID, draft_layers=1)
    DFlashDrafter(config).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["head_dim"] == H // HEADS
    assert written["rope_scaling"]["rope_type"] == "llama3" and written["rope_theta"] == 5e5
    assert DFlashDrafter.from_pretrained(tmp_path).config.rope_parameters == config.rope_parameters


def test_loads_a_checkpoint_written_by_others(tmp_path):
    """A config in the style of the published drafters (torch_dtype, rope_theta, no rope_parameters,
    block_size at the top level) and bf16 tensors written directly with safetensors."""
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "torch_dtype": "bfloat16",
        "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": 2, "num_attention_heads": HEADS,
        "num_key_value_heads": KV, "head_dim": HEAD_DIM, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "rope_scaling": None, "max_position_embeddings": 40960, "vocab_size": VOCAB,
        "attention_bias": False, "tie_word_embeddings": False, "block_size": 16, "num_target_layers": 36,
        "layer_types": ["full_attention", "full_attention"],
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [1, 9, 17, 25, 33]},
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "transformers_version": "4.57.1",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = {"fc.weight": (H, 5 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(2):
        shapes |= {f"layers.{i}.input_layernorm.weight": (H,), f"layers.{i}.post_attention_layernorm.weight": (H,),
                   f"layers.{i}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, H),
                   f"layers.{i}.self_attn.k_proj.weight": (KV * HEAD_DIM, H),
                   f"layers.{i}.self_attn.v_proj.weight": (KV * HEAD_DIM, H),
                   f"layers.{i}.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
                   f"layers.{i}.self_attn.q_norm.weight": (HEAD_DIM,),
                   f"layers.{i}.self_attn.k_norm.weight": (HEAD_DIM,),
                   f"layers.{i}.mlp.gate_proj.weight": (INTER, H), f"layers.{i}.mlp.up_proj.weight": (INTER, H),
                   f"layers.{i}.mlp.down_proj.weight": (H, INTER)}
    torch.manual_seed(1)
    tensors = {k: torch.randn(s).to(torch.bfloat16) for k, s in shapes.items()}
    save_file(tensors, tmp_path / "model.safetensors")
    drafter = DFlashDrafter.from_pretrained(tmp_path)
    assert drafter.config.target_layer_ids == [1, 9, 17, 25, 33] and drafter.config.num_target_layers == 36
    assert drafter.config.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    state = drafter.state_dict()
    for k, v in tensors.items():
        assert torch.equal(state[k], v), k


# What vLLM's and SGLang's DFlash loaders read from config.json, with where they read it
# (docs/ARCHITECTURE.md, "What the loaders read"; vLLM 0.33.0, SGLang 0.5.23), and what the
# exported value must be for drafter config `c`.
ENGINE_FIELDS = {
    "architectures": ("vllm models/registry.py:664; sglang models/dflash.py:1317",
                      lambda c: ["DFlashDraftModel"]),
    "block_size": ("sglang speculative/dflash_utils.py:608-611", lambda c: c.block_size),
    "dflash_config.target_layer_ids": ("vllm eagle3_utils.py:120-124; sglang dflash_utils.py:657-660",
                                       lambda c: c.target_layer_ids),
    "dflash_config.mask_token_id": ("vllm qwen3_dflash.py:454-455; sglang dflash_utils.py:688-697",
                                    lambda c: c.mask_token_id),
    "num_target_layers": ("sglang dflash_utils.py:598-601", lambda c: c.num_target_layers),
    "layer_types": ("vllm qwen3_dflash.py:120-143; sglang dflash_utils.py:388-398", lambda c: c.layer_types),
    "sliding_window": ("vllm qwen3_dflash.py:145-149; sglang dflash_utils.py:400-417",
                       lambda c: c.sliding_window if S in c.layer_types else None),
    "use_sliding_window": ("transformers configuration_qwen3.py:86 (both read the window through Qwen3Config)",
                           lambda c: S in c.layer_types),
    "hidden_size": ("vllm qwen3_dflash.py:334; sglang models/dflash.py:204", lambda c: H),
    "num_attention_heads": ("vllm qwen3_dflash.py:335; sglang models/dflash.py:206", lambda c: HEADS),
    "num_key_value_heads": ("vllm qwen3_dflash.py:337; sglang models/dflash.py:208", lambda c: KV),
    "head_dim": ("vllm qwen3_dflash.py:345; sglang models/dflash.py:210", lambda c: HEAD_DIM),
    "intermediate_size": ("vllm qwen3_dflash.py:354; sglang models/dflash.py:473", lambda c: INTER),
    "hidden_act": ("vllm qwen3_dflash.py:355; sglang models/dflash.py:493", lambda c: "silu"),
    "rms_norm_eps": ("vllm qwen3_dflash.py:338; sglang models/dflash.py:236", lambda c: 1e-5),
    "attention_bias": ("vllm qwen3_dflash.py:339; sglang models/dflash.py:235", lambda c: False),
    "max_position_embeddings": ("vllm qwen3_dflash.py:336; sglang models/dflash.py:270", lambda c: 512),
    "rope_theta": ("sglang models/dflash.py:252 (get_rope_config)", lambda c: 5e5),
    "rope_parameters": ("vllm qwen3_dflash.py:348", lambda c: {"rope_type": "default", "rope_theta": 5e5}),
    "vocab_size": ("vllm qwen3_dflash.py:423", lambda c: VOCAB),
}


def _get(config, path):
    for key in path.split("."):
        config = config[key]
    return config


def _served_attention(hf, i):
    """(window, causal) of drafter layer i as each engine resolves it from the Hugging Face config
    object, written from the rules cited in docs/ARCHITECTURE.md: vLLM `_dflash_layer_causal` /
    `_resolve_layer_attention` (is_causal, else dflash_config.causal, else sliding; window
    config.sliding_window), SGLang `_get_dflash_layer_attention_params` (window_left =
    sliding_window - 1, DECODER for sliding, ENCODER_ONLY for full, is_causal overriding)."""
    types_ = getattr(hf, "layer_types", None) or [F] * hf.num_hidden_layers
    sliding = types_[i] == S
    override = getattr(hf, "is_causal", None)
    vllm_causal = override if override is not None else (hf.dflash_config.get("causal") if
                                                         hf.dflash_config.get("causal") is not None else sliding)
    vllm = (hf.sliding_window if sliding else None, bool(vllm_causal))
    window_left = hf.sliding_window - 1 if sliding else -1
    sglang = (window_left + 1 if window_left >= 0 else None, bool(sliding if override is None else override))
    return vllm, sglang


# layer_types, sliding_window, is_causal, and the (window, causal) each layer is served with.
LAYOUTS = [
    pytest.param(None, None, None, [(None, False)] * 3, id="full"),
    pytest.param([S, S, F], 6, None, [(6, True), (6, True), (None, False)], id="sliding-sliding-full"),
    pytest.param([F, F, F], None, True, [(None, True)] * 3, id="full-is_causal"),
]


@pytest.mark.parametrize("layer_types,window,is_causal,served", LAYOUTS)
def test_exported_config_carries_what_the_engines_read(tmp_path, layer_types, window, is_causal, served):
    drafter = make_drafter(layer_types=layer_types, sliding_window=window, is_causal=is_causal)
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    one_causality = len({causal for _, causal in served}) == 1  # stated; mixed: the layer types say it
    assert set(config) == CONFIG_KEYS | (OPTIONAL_CONFIG_KEYS if one_causality else set())
    for path, (where, expected) in ENGINE_FIELDS.items():
        assert _get(config, path) == expected(drafter.config), f"{path} (read at {where})"
    # The engines read the window and types through transformers' Qwen3Config of the file.
    hf = Qwen3Config.from_pretrained(tmp_path)
    for i in range(3):
        vllm, sglang = _served_attention(hf, i)
        assert vllm == sglang == drafter.config.layer_attention(i), f"layer {i}"
        assert (drafter.layers[i].self_attn.window, drafter.layers[i].self_attn.causal) == vllm
    assert [drafter.config.layer_attention(i) for i in range(3)] == served
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert dataclasses.replace(loaded.config, dtype=drafter.config.dtype) == drafter.config


@pytest.mark.parametrize("layer_types,window,is_causal,served", LAYOUTS)
def test_official_class_gives_the_same_outputs(tmp_path, layer_types, window, is_causal, served):
    """Exported, loaded by the official DFlashDraftModel (PyPI dflash 0.1.0) and run on one
    block with its context: the same final states as our training forward, per layer type."""
    official = official_dflash()
    B, T, anchors = 4, 23, [0, 3, 11, 20]
    drafter = make_drafter(layer_types=layer_types, sliding_window=window, block_size=B, is_causal=is_causal)
    drafter.save_pretrained(tmp_path)
    torch.manual_seed(2)
    embed = torch.randn(VOCAB, H)
    drafter.attach(SharedWeights(embed, embed))
    feats = torch.randn(T, 3 * H)
    tokens = torch.randint(0, VOCAB, (T,))
    model = official.DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    blocks = Anchors(torch.zeros(len(anchors), dtype=torch.int32), torch.tensor(anchors, dtype=torch.int32), B, 0)
    ids = torch.full((len(anchors), B), MASK_ID)
    ids[:, 0] = tokens[anchors]
    pos = torch.tensor(anchors)[:, None] + torch.arange(B)
    cu = torch.tensor([0, T], dtype=torch.int32)
    with torch.no_grad():
        ours = drafter.block_hidden(feats, ids.reshape(-1), pos.reshape(-1), torch.arange(T), (cu, cu), blocks)
        for j, a in enumerate(anchors):
            theirs = model(position_ids=torch.arange(a + B)[None], noise_embedding=embed[ids[j]][None],
                           target_hidden=feats[:a][None])[0]
            torch.testing.assert_close(ours.view(-1, B, H)[j], theirs, rtol=1e-5, atol=1e-5, msg=f"anchor {a}")


@pytest.mark.parametrize("change,message", [
    ({"use_sliding_window": False}, "use_sliding_window is not true"),
    ({"dflash_config": {"causal": True}}, "dflash_config.causal = True is read by vLLM only"),
    ({"layer_types": [F, F], "sliding_window": None, "use_sliding_window": False,
      "dflash_config": {"use_swa": True}}, "dflash_config.use_swa is read by vLLM only"),
    ({"dflash_config": {"swa_window_size": 4096}}, "swa_window_size = 4096 differs from sliding_window = 2048"),
    ({"layer_types": [S, "chunked_attention"]}, re.escape("layer_types holds ['chunked_attention']")),
    ({"layer_types": [S]}, "layer_types has 1 entries for 2 drafter layers"),
    ({"sliding_window": None}, "sliding_attention layers need sliding_window"),
    ({"architectures": ["EagleDraftModel"]}, re.escape("architectures is ['EagleDraftModel']")),
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel lacks dflash_config.conv_kernel_size"),
    ({"dflash_config": {"attention_sink_bias": True}}, "dflash_config.attention_sink_bias = True"),
    ({"target_hidden_size": 128}, "target_hidden_size = 128 != hidden_size"),
])
def test_configs_the_engines_would_serve_differently_are_refused(change, message):
    """Released configs with sliding layers read back as the engines serve them, or are refused
    with the key that makes vLLM and SGLang disagree (or that this drafter does not compute)."""
    config = released_config([S, F], 2048)
    DrafterConfig.from_json_dict(config)  # the released layout itself loads
    for key, value in change.items():
        config[key] = {**config[key], **value} if key == "dflash_config" else value
    with pytest.raises(ValueError, match=message):
        DrafterConfig.from_json_dict(config)


def released_config(layer_types, sliding_window, num_layers=None):
    """A config.json in the style of released drafters with sliding layers (z-lab Qwen3.6 /
    Gemma recipes): torch_dtype, rope_theta, top-level block_size, Qwen3Config's leftovers."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "torch_dtype": "bfloat16",
        "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": num_layers or len(layer_types),
        "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HEAD_DIM, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_scaling": None, "max_position_embeddings": 40960,
        "vocab_size": VOCAB, "attention_bias": False, "tie_word_embeddings": False, "block_size": 16,
        "num_target_layers": 36, "layer_types": layer_types, "sliding_window": sliding_window,
        "use_sliding_window": True, "max_window_layers": 28,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [1, 9, 17, 25, 33]},
    }


def test_released_sliding_config_reads_as_served():
    c = DrafterConfig.from_json_dict(released_config([S, S, S, S, F], 2048))
    assert c.layer_types == [S] * 4 + [F] and c.sliding_window == 2048 and c.is_causal is None
    assert [c.layer_attention(i) for i in range(5)] == [(2048, True)] * 4 + [(None, False)]
    # Qwen3Config's default window with no sliding layer is ignored, as the engines ignore it.
    full = released_config([F, F], 4096)
    full["use_sliding_window"] = False
    assert DrafterConfig.from_json_dict(full).sliding_window is None
    # dflash_config.causal that agrees with every layer's default is served alike: accepted.
    agree = released_config([F, F], None)
    agree["dflash_config"]["causal"] = False
    assert DrafterConfig.from_json_dict(agree).layer_attention(1) == (None, False)
