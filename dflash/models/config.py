"""Drafter configuration and its `config.json` in the official DFlash checkpoint format.

The official format is a Qwen3 config (`model_type: "qwen3"`, `architectures:
["DFlashDraftModel"]`) plus `block_size`, `num_target_layers` and `dflash_config:
{"mask_token_id", "target_layer_ids"}`. Serving engines build the drafter's layers from the
Qwen3 fields, so every size is written explicitly (`head_dim` included: Qwen3Config's default
of 128 would be silently wrong for other head sizes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_NUM_TARGET_FEATURES = 5
# Loss decay per block size from the paper; other block sizes must set gamma explicitly.
GAMMA_BY_BLOCK_SIZE = {16: 7.0, 10: 5.0, 8: 4.0}

# The exact key set of the config.json written by `DrafterConfig.to_json_dict`.
CONFIG_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "dtype",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "max_position_embeddings",
        "vocab_size",
        "attention_bias",
        "attention_dropout",
        "initializer_range",
        "tie_word_embeddings",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
        "block_size",
        "num_target_layers",
        "dflash_config",
    }
)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def default_target_layer_ids(num_target_layers: int, num_features: int = DEFAULT_NUM_TARGET_FEATURES) -> list[int]:
    """Official tap rule: spread from the 2nd layer to the 3rd-from-last.

    layer_i = round(1 + i*(L-4)/(K-1)); a single tap is L//2. Qwen3-8B (L=36, K=5) -> [1, 9, 17, 25, 33].
    Python's round() halves to even, which is also what the official helper gets from round().
    """
    if num_features < 1:
        raise ValueError(f"num_features must be >= 1, got {num_features}")
    if num_features == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(f"the default tap rule needs at least 4 target layers, got {num_target_layers}")
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_features - 1))) for i in range(num_features)]


def check_target_layer_ids(layer_ids: list[int], num_target_layers: int) -> list[int]:
    """Refuse taps that Hugging Face would report after the final norm, or that do not exist.

    `hidden_states[L]` of a Hugging Face forward is the final-normed output, not the residual
    stream, so the last layer (id L-1) cannot be tapped consistently with serving engines.
    """
    layer_ids = [int(i) for i in layer_ids]
    if not layer_ids:
        raise ValueError("target_layer_ids is empty")
    for i in layer_ids:
        if i < 0 or i >= num_target_layers - 1:
            raise ValueError(
                f"target layer id {i} is out of range: the target has {num_target_layers} layers and "
                f"ids must lie in [0, {num_target_layers - 2}] (hidden_states[L] of a Hugging Face "
                f"forward is the final-normed output, so layer {num_target_layers - 1} cannot be tapped)"
            )
    return layer_ids


def default_gamma(block_size: int) -> float:
    if block_size not in GAMMA_BY_BLOCK_SIZE:
        raise ValueError(
            f"no default loss decay gamma for block_size={block_size} (known: "
            f"{sorted(GAMMA_BY_BLOCK_SIZE)}); pass gamma explicitly"
        )
    return GAMMA_BY_BLOCK_SIZE[block_size]


@dataclass
class DrafterConfig:
    """Sizes of the DFlash drafter; the same fields as its official `config.json`.

    Build it with `DrafterConfig.from_target(target_config, ...)`: hidden size, heads, kv heads,
    head_dim, MLP width, RoPE and norm epsilon come from the target.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int  # drafter layers (5 in the paper)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # rows of the target's embedding / lm_head
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})
    max_position_embeddings: int = 40960
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        check_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} lies outside the target's {self.vocab_size} embedding rows"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (an anchor plus drafted slots), got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise ValueError(f"the DFlash drafter uses a SwiGLU MLP (hidden_act 'silu'), got {self.hidden_act!r}")
        if "rope_theta" not in self.rope_parameters:
            raise ValueError("rope_parameters needs a rope_theta")

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target(
        cls,
        target_config,
        *,
        mask_token_id: int,
        block_size: int = 16,
        num_draft_layers: int = 5,
        target_layer_ids: list[int] | None = None,
        num_target_features: int = DEFAULT_NUM_TARGET_FEATURES,
        vocab_size: int | None = None,
    ) -> DrafterConfig:
        """Sizes from a Hugging Face target config (any family of `TargetModel`: its hidden size, heads,
        kv heads, head_dim; the MLP width of `drafter_intermediate_size`).

        vocab_size defaults to the config's; pass the embedding's row count if it differs.
        """
        L = target_config.num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(L, num_target_features)
        head_dim = getattr(target_config, "head_dim", None) or (
            target_config.hidden_size // target_config.num_attention_heads
        )
        dtype = getattr(target_config, "dtype", None) or torch.bfloat16
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        return cls(
            hidden_size=target_config.hidden_size,
            intermediate_size=drafter_intermediate_size(target_config),
            num_hidden_layers=num_draft_layers,
            num_attention_heads=target_config.num_attention_heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", None)
            or target_config.num_attention_heads,
            head_dim=head_dim,
            vocab_size=vocab_size if vocab_size is not None else target_config.vocab_size,
            num_target_layers=L,
            target_layer_ids=list(target_layer_ids),
            mask_token_id=mask_token_id,
            block_size=block_size,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_parameters=_drafter_rope(target_config),
            max_position_embeddings=target_config.max_position_embeddings,
            initializer_range=getattr(target_config, "initializer_range", 0.02),
            dtype=_DTYPE_NAMES.get(dtype, "bfloat16"),
        )

    def to_json_dict(self) -> dict[str, Any]:
        """The official `config.json` content; its keys are exactly `CONFIG_KEYS`."""
        rope = dict(self.rope_parameters)
        rope_theta = rope["rope_theta"]
        # Older readers (transformers 4.x, serving engines) take rope_theta + rope_scaling;
        # transformers 5 reads rope_parameters. Write all three so that every reader agrees.
        rope_scaling = None if rope.get("rope_type", "default") == "default" else {
            k: v for k, v in rope.items() if k != "rope_theta"
        }
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "dtype": self.dtype,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": rope_theta,
            "rope_scaling": rope_scaling,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": self.initializer_range,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        """Read our config.json or one written by others in the official format.

        Accepted variants: `target_layer_ids` / `mask_token_id` / `block_size` inside
        `dflash_config` or at the top level; RoPE as `rope_parameters` or `rope_theta` +
        `rope_scaling`; `dtype` or `torch_dtype`; `head_dim` absent (hidden / heads).
        """
        dflash = d.get("dflash_config") or {}

        def pick(name, default=None):
            if name in dflash:
                return dflash[name]
            return d.get(name, default)

        layer_ids = pick("target_layer_ids")
        mask_id = pick("mask_token_id")
        if layer_ids is None or mask_id is None:
            raise ValueError("config.json lacks dflash_config.target_layer_ids or dflash_config.mask_token_id")
        block_size = pick("block_size")
        if block_size is None:
            raise ValueError("config.json lacks block_size")
        if d.get("layer_types") and any(t != "full_attention" for t in d["layer_types"]):
            raise ValueError(f"only full-attention drafter layers are supported, got layer_types {d['layer_types']}")
        if d.get("attention_bias"):
            raise ValueError("the DFlash drafter has no attention biases (attention_bias must be false)")
        rope = d.get("rope_parameters")
        if rope is None:
            rope = dict(d.get("rope_scaling") or {"rope_type": "default"})
            rope["rope_theta"] = d.get("rope_theta", 10000.0)
        heads = d["num_attention_heads"]
        num_target_layers = d.get("num_target_layers")
        if num_target_layers is None:
            # Written by others without it: the smallest target the taps are valid for.
            num_target_layers = max(layer_ids) + 2
        dtype = d.get("dtype") or d.get("torch_dtype") or "bfloat16"
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            vocab_size=d["vocab_size"],
            num_target_layers=num_target_layers,
            target_layer_ids=list(layer_ids),
            mask_token_id=int(mask_id),
            block_size=int(block_size),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_parameters=dict(rope),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            hidden_act=d.get("hidden_act", "silu"),
            initializer_range=d.get("initializer_range", 0.02),
            dtype=dtype,
        )

    def to_qwen3_config(self):
        """The equivalent transformers Qwen3Config (used for the RoPE tables)."""
        from transformers import Qwen3Config

        d = self.to_json_dict()
        d.pop("architectures")
        d.pop("model_type")
        d.pop("dflash_config")
        d.pop("rope_scaling")
        d.pop("rope_theta")
        return Qwen3Config(**d)


def _rope_parameters(target_config) -> dict[str, Any]:
    rope = getattr(target_config, "rope_parameters", None)
    if rope:
        return rope
    # transformers 4.x configs keep RoPE in rope_theta + rope_scaling.
    out = dict(getattr(target_config, "rope_scaling", None) or {"rope_type": "default"})
    out["rope_theta"] = getattr(target_config, "rope_theta", 10000.0)
    return out


# The drafter is a Qwen3 stack with 1-D positions and RoPE over its whole head dim: a hybrid target's
# multimodal sections and partial rotary (Qwen3.5: 25% of a head) are the target's own, not the drafter's
# (serving engines would apply them to the drafter from its config.json).
_TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def _drafter_rope(target_config) -> dict[str, Any]:
    return {k: v for k, v in _rope_parameters(target_config).items() if k not in _TARGET_ONLY_ROPE_KEYS}


def drafter_intermediate_size(target_config) -> int:
    """The drafter's MLP width: the target's dense MLP width, or for a MoE target without one (Qwen3.5
    MoE) the width a token is routed through (experts per token x expert width)."""
    width = getattr(target_config, "intermediate_size", None)
    if width:
        return width
    return target_config.num_experts_per_tok * target_config.moe_intermediate_size
