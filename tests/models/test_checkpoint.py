"""The official DFlash checkpoint format: exact tensor names, config keys, round trips."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, Qwen3Config

from dflash.models import CONFIG_KEYS, DFlashDrafter, DrafterConfig

H, HEADS, KV, HEAD_DIM, INTER, VOCAB, MASK_ID = 64, 4, 2, 16, 96, 300, 297


def target_config(**kw):
    return Qwen3Config(vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=8,
                       num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM,
                       max_position_embeddings=512, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 5e5}, **kw)


def make_drafter(num_layers=3, taps=(1, 3, 6), dtype=torch.float32):
    config = DrafterConfig.from_target(target_config(), mask_token_id=MASK_ID, block_size=16,
                                       num_draft_layers=num_layers, target_layer_ids=list(taps))
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).to(dtype)
    with torch.no_grad():  # norms away from 1 so a mix-up between them would show
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return drafter


def expected_names(num_layers):
    """The tensor names of the official format, written out from the specification."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
        names |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    return names


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
    assert set(config) == CONFIG_KEYS
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["head_dim"] == HEAD_DIM
    assert config["block_size"] == 16 and config["num_target_layers"] == 8
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3, 6]}
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip_is_exact(tmp_path, dtype):
    drafter = make_drafter(dtype=dtype)
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert loaded.config.dtype == str(dtype).removeprefix("torch.")  # the dtype written is the weights'
    assert dataclasses.replace(loaded.config, dtype=drafter.config.dtype) == drafter.config
    a, b = drafter.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == dtype and torch.equal(a[k], b[k]), k


def test_scaled_rope_round_trips(tmp_path):
    llama = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=8,
                        num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=4096,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 1024})
    config = DrafterConfig.from_target(llama, mask_token_id=MASK_ID, num_draft_layers=1)
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


@pytest.mark.parametrize("change", ["unknown", "missing"])
def test_tensor_set_mismatch_is_an_error(tmp_path, change):
    drafter = make_drafter(num_layers=1)
    drafter.save_pretrained(tmp_path)
    tensors = dict(drafter.state_dict())
    if change == "unknown":
        tensors["layers.0.self_attn.q_proj.bias"] = torch.zeros(HEADS * HEAD_DIM)
    else:
        del tensors["hidden_norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=change):
        DFlashDrafter.from_pretrained(tmp_path)
