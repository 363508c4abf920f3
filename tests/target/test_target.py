"""TargetModel: packed and padded features against per-sample Hugging Face forwards."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from dflash.models import (
    TargetModel,
    default_target_layer_ids,
    ensure_mask_token,
)
from dflash.sizing.flops import measure_flops, target_forward_flops

from .target_helpers import VOCAB, make_batches, reference_features

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=256,
)

CONFIGS = {
    "qwen3": lambda: Qwen3Config(head_dim=16, **COMMON),
    "llama": lambda: LlamaConfig(**COMMON),
    "qwen2": lambda: Qwen2Config(**COMMON),  # q/k/v biases
    "mistral": lambda: MistralConfig(sliding_window=None, **COMMON),
}
TAPS = [1, 2, 4]


def tiny_models(family: str, seed: int = 0):
    """(model for TargetModel, an eager-attention copy with the same weights as reference)."""
    torch.manual_seed(seed)
    config = CONFIGS[family]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    reference.load_state_dict(model.state_dict())
    return model, reference


@pytest.mark.parametrize("family", list(CONFIGS))
def test_packed_features_match_per_sample_forward(family):
    model, reference = tiny_models(family)
    target = TargetModel(model, TAPS)
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 60, size=5).tolist()
    samples, packed, _ = make_batches(lengths)
    feats = target.features(packed)
    assert feats.shape == (sum(lengths), len(TAPS) * 64)
    torch.testing.assert_close(feats, reference_features(reference, samples, TAPS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_padded_features_match_per_sample_forward(family):
    model, reference = tiny_models(family, seed=1)
    target = TargetModel(model, [3, 1])  # list order, not sorted order
    samples, _, padded = make_batches([7, 40, 23], seed=2)
    feats = target.features(padded)
    torch.testing.assert_close(feats, reference_features(reference, samples, [3, 1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_output_states_give_the_per_sample_logits(layout):
    model, reference = tiny_models("qwen3", seed=3)
    target = TargetModel(model, [1, 3])
    samples, packed, padded = make_batches([7, 30, 12], seed=4)
    feats, output = target.features(packed if layout == "packed" else padded, with_output=True)
    torch.testing.assert_close(feats, reference_features(reference, samples, [1, 3]), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        logits = torch.cat([reference(s[None]).logits[0] for s in samples])
    torch.testing.assert_close(output @ target.shared_weights().lm_head.t(), logits, rtol=1e-4, atol=1e-4)


def test_forward_stops_after_last_tapped_layer():
    model, _ = tiny_models("qwen3")
    target = TargetModel(model, [2, 0])
    calls = []
    base = model.base_model
    for i, layer in enumerate(base.layers):
        layer.register_forward_hook(lambda *_, i=i: calls.append(i))
    base.norm.register_forward_hook(lambda *_: calls.append("norm"))
    model.lm_head.register_forward_hook(lambda *_: calls.append("lm_head"))
    target.features(make_batches([5, 9])[1])
    assert calls == [0, 1, 2]


def test_target_is_frozen_and_stays_in_eval():
    model, _ = tiny_models("llama")
    target = TargetModel(model, TAPS)
    target.train()
    assert not target.training and not model.training
    assert not any(p.requires_grad for p in target.parameters())
    assert not target.features(make_batches([6])[1]).requires_grad


def test_default_layer_ids_follow_official_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert default_target_layer_ids(36, 1) == [18]
    model, _ = tiny_models("qwen3")
    assert TargetModel(model, num_features=3).target_layer_ids == [1, 2, 3]  # round(1 + i*2/2)


@pytest.mark.parametrize("bad", [[5], [1, 6], [-1]])
def test_layer_ids_past_last_tappable_are_refused(bad):
    model, _ = tiny_models("qwen3")  # 6 layers: ids 0..4 allowed
    with pytest.raises(ValueError, match="out of range"):
        TargetModel(model, bad)


def _word_tokenizer(num_words: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(num_words - 1)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_mask_token_takes_a_spare_embedding_row():
    tokenizer = _word_tokenizer(250)
    mask_id = ensure_mask_token(tokenizer, num_embedding_rows=VOCAB)
    assert mask_id == 250 and tokenizer.convert_ids_to_tokens(mask_id) == "<|MASK|>"
    assert tokenizer("w3 <|MASK|>")["input_ids"] == [4, 250]
    assert ensure_mask_token(tokenizer, VOCAB) == 250 and len(tokenizer) == 251  # added once


def test_mask_token_without_spare_row_is_a_clear_error_with_a_fix_the_cli_reaches():
    tokenizer = _word_tokenizer(VOCAB - 1)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|reserved_0|>"]})  # the last row
    with pytest.raises(ValueError, match=rf"the mask token '<\|MASK\|>' would get id {VOCAB}, but the target's "
                                         rf"embedding has {VOCAB} rows .* train.py --mask-token TEXT \(this "
                                         r"tokenizer's special tokens that its chat template does not use: "
                                         rf"'<\|reserved_0\|>'\); or .*resize_token_embeddings\({VOCAB + 1}\)"):
        ensure_mask_token(tokenizer, num_embedding_rows=VOCAB)
    assert len(tokenizer) == VOCAB, "left as it was"
    assert ensure_mask_token(tokenizer, VOCAB, token="<|reserved_0|>") == VOCAB - 1  # --mask-token: reused


def test_packed_flops_are_those_of_the_real_tokens():
    """Counted FLOPs of the packed forward = sum over samples alone; padded pays count x longest."""
    model, _ = tiny_models("qwen3")
    target = TargetModel(model, TAPS)
    lengths = [9, 48, 17, 30]
    _, packed, padded = make_batches(lengths)
    packed_flops, _ = measure_flops(target.features, packed)
    per_sample = sum(measure_flops(target.features, make_batches([n])[1])[0] for n in lengths)
    padded_flops, _ = measure_flops(target.features, padded)
    num_layers = max(TAPS) + 1
    assert packed_flops == per_sample == target_forward_flops(model.config, lengths, num_layers)
    assert padded_flops == target_forward_flops(model.config, lengths, num_layers, "padded")
    assert padded_flops > 1.5 * packed_flops
