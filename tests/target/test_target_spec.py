"""`TargetSpec`: what every command knows of the target before its weights load, from one resolution."""
import json

import pytest

from dflash.errors import UserError
from dflash.sizing.flops import load_target_config
from dflash.target.spec import PRESETS, load_target_spec
from dflash.target.taps import default_target_layer_ids


def test_a_random_preset_is_the_sizing_tools_preset():
    """One table: `random:qwen3-8b` trains the model that plan_memory.py and plan_batches.py size."""
    random, sized = load_target_spec("random:qwen3-8b"), load_target_spec("qwen3-8b", bare_presets=True)
    assert random.random and not sized.random and random.folder is None
    assert random.config.to_dict() == sized.config.to_dict() == load_target_config("qwen3-8b").to_dict()
    assert (random.family, random.num_layers, random.embedding_rows) == ("qwen3", 36, 151936)
    assert random.default_layer_ids(5) == default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert random.fingerprint() == {"path": "random:qwen3-8b"} and random.generation_eos() is None
    with pytest.raises(UserError, match="a preset is a shape without weights; give random:qwen3-8b"):
        load_target_spec("qwen3-8b")  # a bare preset has no weights to train with


def test_a_folder_spec_reads_its_config_and_hashes_its_files(tmp_path):
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, eos_token_id=7).save_pretrained(tmp_path)
    spec = load_target_spec(tmp_path)
    assert (spec.folder, spec.random, spec.num_layers, spec.embedding_rows, spec.hidden_size) == (
        tmp_path, False, 6, 64, 32)
    assert spec.generation_eos() == 7
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    before = spec.fingerprint()
    (tmp_path / "model.safetensors").write_bytes(b"weight2")
    assert spec.fingerprint()["path"] == str(tmp_path.resolve()) and spec.fingerprint()["sha256"] != before["sha256"]


def test_a_random_shape_without_sizes_is_refused_too(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(UserError, match=r"missing num_attention_heads, num_hidden_layers, vocab_size, "
                                         r"intermediate_size"):
        load_target_spec(f"random:{tmp_path}")
    assert set(PRESETS) == {"qwen3-8b", "qwen3.5-27b", "qwen3.5-122b-a10b"}
