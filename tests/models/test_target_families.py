"""TargetModel on every target family: packed features equal per-sample Hugging Face forwards
(fp32, relative error <= 1e-4), samples longer than a sliding window and of one token included;
image-text checkpoints load their language model only."""
from __future__ import annotations

import pytest
import torch

from dflash.models import TargetModel, load_target

from ..tiny_targets import CONFIGS, WINDOW, tiny_target
from .test_target import make_batches, reference_features

FAMILIES = [f for f in CONFIGS if f != "qwen3"]
LENGTHS = [3 * WINDOW + 5, 1, 17, 1, 2 * WINDOW, 40]  # past the window, one token, at 2x the window
# Backends on the CPU: the reference (auto), FlexAttention, and the Triton interpreter where it has
# what the family needs (no sliding window in the kernels: torch_varlen serves it on the GPU)
CASES = [(f, b) for f in FAMILIES for b in ("auto", "flex", "triton") if not (f == "gpt_oss" and b == "triton")]


def _rel_err(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


def _taps(model):
    return [0, 1, model.config.num_hidden_layers - 2]  # through the last layer a tap may run


@pytest.mark.parametrize("family,backend", CASES)
def test_packed_features_match_per_sample_forward(family, backend):
    model = tiny_target(family)
    reference = tiny_target(family)  # same seed, same weights, untouched by TargetModel
    target = TargetModel(model, _taps(model), attention_backend=backend)
    samples, packed, padded = make_batches(LENGTHS)
    want = reference_features(reference, samples, _taps(model))
    got = target.features(packed)
    assert got.shape == want.shape
    per_row = (got - want).norm(dim=-1) / want.norm(dim=-1)  # every token of every sample
    assert per_row.max() <= 1e-4, f"{family}: worst row {per_row.max():.2e} at {int(per_row.argmax())}"
    if backend == "auto":
        got_padded = target.features(padded)
        assert _rel_err(got_padded, want) <= 1e-4, f"{family}: padded relative error {_rel_err(got_padded, want):.2e}"


def test_image_text_checkpoint_loads_its_language_model_only(tmp_path):
    """A Qwen3.5 image-text checkpoint (...ForConditionalGeneration): load_target gives the causal LM
    of its text config with the checkpoint's weights, no vision tower, the same tapped layers."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    text = CONFIGS["qwen3_5_text"]().to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    full = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).float().eval()
    full.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="load_target"):
        TargetModel(full)
    lm = load_target(tmp_path, torch.float32)
    assert type(lm).__name__ == "Qwen3_5ForCausalLM"
    assert not any("visual" in name for name, _ in lm.named_parameters())
    taps = _taps(lm)
    samples, packed, _ = make_batches([30, 1, 12])
    got = TargetModel(lm, taps).features(packed)
    with torch.no_grad():  # the full image-text model on text alone
        want = torch.cat([torch.cat([full(s[None], output_hidden_states=True).hidden_states[i + 1][0] for i in taps],
                                    -1) for s in samples])
    assert _rel_err(got, want) <= 1e-4
