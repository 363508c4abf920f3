"""A small drafter and the official format's tensor names, shared by the checkpoint tests
(tests/drafter/test_checkpoint.py) and the training safety tests (tests/training/test_safety.py)."""
import dataclasses

import torch
from transformers import Qwen3Config

from dflash.models import DFlashDrafter, DrafterConfig

H, HEADS, KV, HEAD_DIM, INTER, VOCAB, MASK_ID = 64, 4, 2, 16, 96, 300, 297


def target_config(**kw):
    return Qwen3Config(vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=8,
                       num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM,
                       max_position_embeddings=512, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 5e5}, **kw)


def make_drafter(num_layers=3, taps=(1, 3, 6), dtype=torch.float32, layer_types=None, sliding_window=None,
                 block_size=16, is_causal=None):
    config = DrafterConfig.from_target(target_config(), mask_token_id=MASK_ID, block_size=block_size,
                                       draft_layers=num_layers, target_layer_ids=list(taps),
                                       layer_types=layer_types, sliding_window=sliding_window)
    config = dataclasses.replace(config, is_causal=is_causal)
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
