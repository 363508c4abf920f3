"""DFlash2 runs: from scratch (--drafter-kind dflash2) and from a released-format DFlash2 drafter
(--init-drafter), end to end on CPU ranks."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.drafter.config_format import SLIDING
from dflash.drafter.kinds.dflash2 import DFlash2Drafter
from dflash.models import DFlashDrafter, DrafterConfig
from dflash.testing import train_in_process
from dflash.training.config import load_config

from ..runs import read_metrics, tiny_train_args


def released_dflash2(folder, hf: dict, **dflash_config):
    """A DFlash2 drafter folder written as z-lab's fixture (tests/fixtures/dflash2-config.json) is, at
    reduced sizes: every drafter setting in dflash_config, is_causal at the top level, the release's
    extra keys, bf16 tensors, the codebooks named without `.weight`."""
    settings = {"block_size": 4, "conv_group_size": 16, "conv_kernel_size": 2, "final_logit_softcapping": 20.0,
                "mask_token_id": hf["vocab_size"] - 1, "output_multiplier": 0.5, "selector_rank": 8,
                "selector_top_k": 6, "target_layer_ids": [0, 1], **dflash_config}
    config = {"architectures": ["DFlash2DraftModel"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": None, "is_causal": False, "dflash_config": settings, "dtype": "bfloat16",
              "eos_token_id": hf["eos_token_id"], "head_dim": hf["head_dim"], "hidden_act": "silu",
              "hidden_size": hf["hidden_size"], "initializer_range": 0.02,
              "intermediate_size": hf["intermediate_size"], "layer_types": [SLIDING] * 2,
              "max_position_embeddings": 512, "max_window_layers": 2, "model_type": "qwen3",
              "num_attention_heads": hf["num_attention_heads"], "num_hidden_layers": 2,
              "num_key_value_heads": hf["num_key_value_heads"], "num_target_layers": hf["num_hidden_layers"],
              "pad_token_id": hf["pad_token_id"], "rms_norm_eps": 1e-05,
              "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "sliding_window": 64,
              "tie_word_embeddings": False, "transformers_version": "5.15.0", "use_cache": False,
              "use_sliding_window": True, "vocab_size": hf["vocab_size"]}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(5)
    drafter = DFlash2Drafter(DrafterConfig.from_json_dict(config))
    with torch.no_grad():  # away from the identity start, so that the run's start shows
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in drafter.export_tensors().items()}
    save_file(weights, folder / "model.safetensors")
    return folder, weights


def test_a_dflash2_run_from_scratch_trains_and_exports_the_released_format(tiny_run_inputs, tmp_path):
    target, data = tiny_run_inputs
    out = tmp_path / "run"
    train_in_process(tiny_train_args(target, data, out, "--drafter-kind", "dflash2", "--max-steps", 3,
                                     "--block-size", 4, "--gamma", 2, "--selector-weight", 0.5))
    train = read_metrics(out)
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] for r in train)
    # the selector's figures in the train and eval records (their numbers: tests/drafter/test_dflash2.py)
    for r in train + read_metrics(out, "eval")[-1:]:
        assert 0 <= r["selector_accuracy"] <= r["selector_recall"] <= 1 and r["argmax_anchor_tau"] >= 1, r
    assert read_metrics(out, "eval")[-1]["argmax_tau"] >= 1
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert config["layer_types"] == [SLIDING] and config["sliding_window"] == 2048
    assert {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}.items() <= \
        config["dflash_config"].items()
    tensors = load_file(out / "drafter" / "model.safetensors")
    assert "candidate_selector.predecessor_codebook" in tensors
    # trained: the convolutions left the identity and the selector's projection left 0
    assert tensors["layers.0.attention_conv.kernel_projection.weight"].abs().sum() > 0
    assert tensors["candidate_selector.hidden_projection.weight"].abs().sum() > 0
    assert isinstance(DFlashDrafter.from_pretrained(out / "drafter"), DFlash2Drafter)


@pytest.mark.slow
def test_a_released_dflash2_drafter_continues_training(tiny_run_inputs, tmp_path):
    target, data = tiny_run_inputs
    hf = json.loads((target / "config.json").read_text())
    folder, weights = released_dflash2(tmp_path / "released", hf)
    c = load_config(["--target", str(target), "--data", str(data), "--init-drafter", str(folder), "--gamma", "2"])
    d = c.drafter
    assert (d.drafter_kind, d.block_size, d.draft_layers, d.sliding_window) == ("dflash2", 4, 2, 64)
    out = tmp_path / "run"
    args = tiny_train_args(target, data, out, "--init-drafter", folder, "--max-steps", 2, "--lr", 1e-9, "--gamma", 2)
    for flag in ("--draft-layers", "--num-target-features"):  # taken from the drafter
        i = args.index(flag)
        del args[i:i + 2]
    train_in_process(args)
    exported = json.loads((out / "drafter" / "config.json").read_text())
    released = json.loads((folder / "config.json").read_text())
    # the release's settings, and what the export states for the engines besides (dflash.drafter.serving)
    assert released["dflash_config"].items() <= exported["dflash_config"].items()
    assert exported["is_causal"] is False and exported["architectures"] == ["DFlash2DraftModel"]
    trained = load_file(out / "drafter" / "model.safetensors")
    assert trained.keys() == weights.keys()
    for name, w in weights.items():
        torch.testing.assert_close(trained[name].float(), w.float(), rtol=0, atol=1e-5, msg=name)
