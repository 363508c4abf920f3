"""TargetModel on every target family: packed features equal per-sample Hugging Face forwards
(fp32, relative error <= 1e-4), samples longer than a sliding window and of one token included;
image-text checkpoints load their language model only."""
from __future__ import annotations

import pytest
import torch

from dflash.demo.families import CONFIGS, VOCAB, WINDOW, tiny_target
from dflash.models import TargetModel, load_language_model

from .target_helpers import make_batches, reference_features

FAMILIES = [f for f in CONFIGS if f != "qwen3"]
LENGTHS = [3 * WINDOW + 5, 1, 17, 1, 2 * WINDOW, 40]  # past the window, one token, at 2x the window
# Backends on the CPU: the reference (auto), FlexAttention and the Triton interpreter
CASES = [(f, b) for f in FAMILIES for b in ("auto", "flex", "triton")]


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
    """A Qwen3.5 image-text checkpoint (...ForConditionalGeneration): load_language_model gives the causal LM
    of its text config with the checkpoint's weights, no vision tower, the same tapped layers."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    text = CONFIGS["qwen3_5_text"]().to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    full = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).float().eval()
    full.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="load_language_model"):
        TargetModel(full)
    lm = load_language_model(tmp_path, torch.float32)
    assert type(lm).__name__ == "Qwen3_5ForCausalLM"
    assert not any("visual" in name for name, _ in lm.named_parameters())
    taps = _taps(lm)
    samples, packed, _ = make_batches([30, 1, 12])
    got = TargetModel(lm, taps).features(packed)
    with torch.no_grad():  # the full image-text model on text alone
        want = torch.cat([torch.cat([full(s[None], output_hidden_states=True).hidden_states[i + 1][0] for i in taps],
                                    -1) for s in samples])
    assert _rel_err(got, want) <= 1e-4


# --- the cost model of each family ---------------------------------------------------------------

def _eager_experts(model):
    model.set_experts_implementation("eager")  # FlopCounterMode has no formula for grouped_mm
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_feature_flops_match_a_flop_counter(family):
    """MoE (active experts only), MLA (q/k and v head dims), sliding layers (samples within the
    window, where the reference's dense scores are the window's): FlopCounterMode on the packed
    feature forward equals target_forward_flops."""
    from dflash.sizing.flops import measure_flops, target_forward_flops

    model = _eager_experts(tiny_target(family))
    layers = model.config.num_hidden_layers - 1
    lengths = [WINDOW, 3, 1, 5]
    counted, _ = measure_flops(TargetModel(model, [layers - 1]).features, make_batches(lengths)[1])
    assert counted == target_forward_flops(model.config, lengths, layers)


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_hybrid_flops_match_transformers_chunked_forward(family):
    """Gated DeltaNet layers cost per token: FlopCounterMode on transformers' own chunked forward of
    each sample (lengths a multiple of its 64-token chunk) equals target_forward_flops plus the
    lm_head and the W - 1 convolution outputs per sample and layer that transformers computes and drops."""
    from dflash.sizing.flops import measure_flops, target_forward_flops

    # Frozen, as a target is: transformers' hub-kernel wrapper (transformers >= 5.25 with `kernels`)
    # hands the flop counter's module tracker a no-grad view of the trainable conv weight, which
    # torch cannot hook ("Expected gradient function to be set").
    model = _eager_experts(tiny_target(family)).requires_grad_(False)
    c = model.config
    lengths = [64, 128]
    counted = 0
    with torch.no_grad():
        for n in lengths:
            counted += measure_flops(model, torch.randint(0, c.vocab_size, (1, n)))[0]
    linear_layers = c.layer_types.count("linear_attention")
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    dropped = len(lengths) * linear_layers * 2 * c.linear_conv_kernel_dim * conv_dim * (c.linear_conv_kernel_dim - 1)
    lm_head = 2 * c.hidden_size * c.vocab_size * sum(lengths)
    assert counted == target_forward_flops(c, lengths, c.num_hidden_layers) + lm_head + dropped


def test_window_pairs_count_the_sliding_mask():
    """window_pairs(n, W) = 2 x the (query, key) pairs of transformers' sliding-window mask - n."""
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay

    from dflash.data.cost import window_pairs

    for n in (1, 5, WINDOW, WINDOW + 1, 3 * WINDOW + 5):
        i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        visible = causal_mask_function(0, 0, i, j) & sliding_window_overlay(WINDOW)(0, 0, i, j)
        assert window_pairs([n], WINDOW)[0] == 2 * int(visible.sum()) - n


@pytest.mark.parametrize("family", FAMILIES)
def test_cost_model_of_a_config_file_prices_the_family(family, tmp_path):
    """plan_batches.py --target config.json and the trainer (a live config) get the same FLOP model,
    and its target terms are those of target_forward_flops (causal: half the dense pairs)."""
    from dflash.data.cost import window_pairs
    from dflash.sizing.flops import flop_cost_model, load_target_config, target_forward_flops

    config = CONFIGS[family]()
    config.save_pretrained(tmp_path)
    layers = config.num_hidden_layers - 1
    live = flop_cost_model(config, num_target_layers=layers, draft_layers=2, num_features=3)
    assert flop_cost_model(load_target_config(str(tmp_path)), num_target_layers=layers, draft_layers=2,
                           num_features=3) == live
    assert live.window == (WINDOW if family == "gpt_oss" else 0)
    assert (live.per_window_pair > 0) == (family == "gpt_oss")
    h, hkv = config.hidden_size, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    context = 3 * (2 * 3 * h * h + 2 * 2 * h * 2 * hkv * d)  # drafter: fc and K/V of the context
    for n in (1, 7, 40):
        target = (live.per_token - context) * n + live.per_pair * n * n + live.per_window_pair * window_pairs(
            [n], live.window)[0]
        dense = target_forward_flops(config, [n], layers)
        linear = target_forward_flops(config, [1], layers) - (live.per_pair + live.per_window_pair) * 2
        assert target == pytest.approx(linear * n + (dense - linear * n) / 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_config_of_each_family(family):
    """The drafter copies the target's sizes; a MoE target without a dense MLP width gives the width a
    token is routed through; the hybrid's partial rotary and multimodal RoPE sections stay the target's."""
    from dflash.models import DrafterConfig

    config = CONFIGS[family]()
    drafter = DrafterConfig.from_target(config, mask_token_id=VOCAB - 1, draft_layers=1)
    assert drafter.hidden_size == config.hidden_size and drafter.num_attention_heads == config.num_attention_heads
    dense = getattr(config, "intermediate_size", None)
    assert drafter.intermediate_size == (dense or config.num_experts_per_tok * config.moe_intermediate_size)
    assert not {"partial_rotary_factor", "mrope_section", "mrope_interleaved"} & set(drafter.rope_parameters)
    assert drafter.rope_parameters["rope_theta"] == config.rope_parameters["rope_theta"]


def test_unknown_linear_attention_module_is_refused():
    """A linear-attention layer whose module dflash does not know would run over the whole packed row
    (state and convolution crossing samples): refused at construction, never run."""
    model = tiny_target("qwen3_5_text")
    layer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    layer.in_proj_fused = layer.in_proj_qkv  # as if another transformers version had renamed it
    del layer.in_proj_qkv
    with pytest.raises(ValueError, match="4 linear-attention layers but 3 Gated DeltaNet modules"):
        TargetModel(model, [0, 1])
