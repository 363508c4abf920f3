"""Tiny random targets of every family TargetModel serves, built from transformers' own model code
(nothing downloaded): a few layers, hidden size 64, shapes that exercise each family's quirk."""
from __future__ import annotations

import torch

VOCAB = 300
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, tie_word_embeddings=False)
WINDOW = 8  # gpt-oss sliding layers: samples in the tests run past it


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(head_dim=16, num_hidden_layers=6, **_COMMON)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(head_dim=16, num_hidden_layers=4, moe_intermediate_size=32, num_experts=8,
                          num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], **_COMMON)


def _qwen3_5(moe: bool):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    hybrid = dict(head_dim=16, num_hidden_layers=6, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                  linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                  layer_types=["linear_attention", "linear_attention", "full_attention"] * 2)
    if moe:  # as Qwen3.5-MoE's config.json: no dense MLP width
        common = {k: v for k, v in _COMMON.items() if k != "intermediate_size"}
        return Qwen3_5MoeTextConfig(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                                    num_experts_per_tok=2, **hybrid, **common)
    return Qwen3_5TextConfig(**hybrid, **_COMMON)


def _gpt_oss():
    from transformers import GptOssConfig

    common = {**_COMMON, "intermediate_size": 32, "max_position_embeddings": 131072}  # YaRN: 32 x 4096
    return GptOssConfig(head_dim=16, num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2, **common)


def _deepseek_v3():
    from transformers import DeepseekV3Config

    common = {**_COMMON, "num_key_value_heads": 4}
    # q/k head dim 16 + 8 = 24, v head dim 16: MLA's unequal head dims (192 / 128 at full size)
    return DeepseekV3Config(num_hidden_layers=4, moe_intermediate_size=32, n_routed_experts=8, n_group=2,
                            topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
                            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                            v_head_dim=16, **common)


CONFIGS = {
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "qwen3_5_text": lambda: _qwen3_5(moe=False),
    "qwen3_5_moe_text": lambda: _qwen3_5(moe=True),
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
}


def tiny_target(family: str, seed: int = 0):
    """A float32 causal LM of `family` with random weights (attention sinks and MoE biases random too)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks") or "e_score_correction_bias" in name:
                p.normal_(0.0, 1.0)
    return model
