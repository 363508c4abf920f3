"""Drafter configuration and its `config.json` in the official DFlash checkpoint format.

The official format is a Qwen3 config (`model_type: "qwen3"`, `architectures:
["DFlashDraftModel"]`) plus `block_size`, `num_target_layers` and `dflash_config:
{"mask_token_id", "target_layer_ids"}`. Serving engines build the drafter's layers from the
Qwen3 fields, so every size is written explicitly (`head_dim` included: Qwen3Config's default
of 128 would be silently wrong for other head sizes). The format's keys, layer types and the
refusals of what engines would serve differently: `dflash.drafter.config_format`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dflash.drafter.config_format import SLIDING, check_engine_agreement, check_layer_types, check_supported
from dflash.drafter.kinds import DEFAULT, drafter_kind, kind_of_architectures
from dflash.drafter.serving import state_serving_fields
from dflash.target.taps import DEFAULT_NUM_TARGET_FEATURES, check_target_layer_ids, default_target_layer_ids

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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
    layer_types: list[str] | None = None  # one of LAYER_TYPES per layer; None: all full_attention
    sliding_window: int | None = None  # positions a sliding layer sees, the query's own included
    is_causal: bool | None = None  # overrides every layer's causality (engines' top-level is_causal)
    kind: str = DEFAULT  # its drafter kind (`dflash.drafter.kinds`), which its architecture names
    kind_settings: Any = None  # what the kind adds to a DFlash drafter's config (None: nothing)

    def __post_init__(self) -> None:
        try:
            check_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        except ValueError as e:
            raise ValueError(f"dflash_config.target_layer_ids: {e}") from None
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers, self.sliding_window)
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            raise ValueError(f"is_causal must be true, false or absent, got {self.is_causal!r}")
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
        drafter_kind(self.kind).check_settings(self)

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    def layer_attention(self, i: int) -> tuple[int | None, bool]:
        """(window, causal) of layer i, as vLLM and SGLang serve it: a sliding layer has the
        window and is causal, a full layer neither; `is_causal` overrides the causality."""
        sliding = self.layer_types[i] == SLIDING
        causal = sliding if self.is_causal is None else self.is_causal
        return (self.sliding_window if sliding else None), causal

    @classmethod
    def from_target(
        cls,
        target_config,
        *,
        mask_token_id: int,
        block_size: int = 16,
        draft_layers: int = 5,
        target_layer_ids: list[int] | None = None,
        num_target_features: int = DEFAULT_NUM_TARGET_FEATURES,
        vocab_size: int | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        kind: str = DEFAULT,
        kind_settings: Any = None,
        is_causal: bool | None = None,
    ) -> DrafterConfig:
        """Sizes from a Hugging Face target config (any family of `TargetModel`: its hidden size, heads,
        kv heads, head_dim; the MLP width of `drafter_intermediate_size`).

        vocab_size defaults to the config's; pass the embedding's row count if it differs.
        layer_types / sliding_window: the drafter's own layer types (default all full_attention).
        kind, kind_settings: the drafter kind and its settings (`dflash.drafter.kinds`);
        is_causal: the top-level override of every layer's causality.
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
            num_hidden_layers=draft_layers,
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
            layer_types=None if layer_types is None else list(layer_types),
            sliding_window=sliding_window,
            is_causal=is_causal,
            kind=kind,
            kind_settings=kind_settings,
        )

    def to_json_dict(self) -> dict[str, Any]:
        """The official `config.json` content; its keys are `CONFIG_KEYS` (and `is_causal` when set).

        `use_sliding_window` is true when a layer slides: transformers' Qwen3Config drops
        `sliding_window` otherwise, and vLLM, SGLang and the official class read it from there.
        """
        rope = dict(self.rope_parameters)
        rope_theta = rope["rope_theta"]
        # Older readers (transformers 4.x, serving engines) take rope_theta + rope_scaling;
        # transformers 5 reads rope_parameters. Write all three so that every reader agrees.
        rope_scaling = None if rope.get("rope_type", "default") == "default" else {
            k: v for k, v in rope.items() if k != "rope_theta"
        }
        sliding = SLIDING in self.layer_types
        out = {
            "architectures": [drafter_kind(self.kind).architecture],
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
            "use_sliding_window": sliding,
            "sliding_window": self.sliding_window if sliding else None,
            # Read only when layer_types is absent (Qwen3Config: layers >= max_window_layers slide).
            "max_window_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        drafter_kind(self.kind).write_config(self, out)
        return state_serving_fields(out, self)

    @staticmethod
    def gives_num_target_layers(d: dict[str, Any]) -> bool:
        """Whether a config.json says how many layers its target has (others leave it out)."""
        return "num_target_layers" in (d.get("dflash_config") or {}) or "num_target_layers" in d

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        """Read our config.json or one written by others in the official format.

        Accepted variants: `target_layer_ids` / `mask_token_id` / `block_size` inside
        `dflash_config` or at the top level; RoPE as `rope_parameters` or `rope_theta` +
        `rope_scaling`; `dtype` or `torch_dtype`; `head_dim` absent (hidden / heads).
        Refused, naming the key: layer types vLLM and SGLang would serve differently
        (`check_engine_agreement`) and features this drafter does not implement.
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
        check_engine_agreement(d)
        kind = kind_of_architectures(d.get("architectures"))
        check_supported(d, kind.config_keys)
        layer_types = d.get("layer_types")
        sliding = bool(layer_types) and SLIDING in layer_types
        if d.get("attention_bias"):
            raise ValueError("the DFlash drafter has no attention biases (attention_bias must be false)")
        rope = d.get("rope_parameters")
        if rope is None:
            rope = dict(d.get("rope_scaling") or {"rope_type": "default"})
            rope["rope_theta"] = d.get("rope_theta", 10000.0)
        heads = d["num_attention_heads"]
        num_target_layers = pick("num_target_layers")
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
            block_size=kind.read_block_size(int(block_size)),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_parameters=dict(rope),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            hidden_act=d.get("hidden_act", "silu"),
            initializer_range=d.get("initializer_range", 0.02),
            dtype=dtype,
            layer_types=None if layer_types is None else list(layer_types),
            # Configs in the wild carry Qwen3Config's default window with no sliding layer.
            sliding_window=d.get("sliding_window") if sliding else None,
            # what the layer types give every layer anyway (as the export states it) reads as no override
            is_causal=_override(d.get("is_causal"), layer_types, d["num_hidden_layers"]),
            kind=kind.name,
            kind_settings=kind.read_settings(d),
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
        d.pop("is_causal", None)
        return Qwen3Config(**d)


def _override(is_causal, layer_types, num_layers: int) -> bool | None:
    """A config.json's `is_causal` as an override: None where every layer's type gives it already."""
    types = layer_types or [None] * num_layers  # none given: every layer full
    if is_causal is not None and all(bool(is_causal) == (t == SLIDING) for t in types):
        return None
    return is_causal


def check_fits_target(config: DrafterConfig, target_config, num_embedding_rows: int | None = None, *,
                      num_target_layers_given: bool = True) -> None:
    """Raise ValueError naming the drafter's config.json field that does not fit the target: the
    hidden size (the target's embedding and lm_head are lent), the vocabulary (embedding rows),
    the tapped layers and the number of target layers the drafter was trained on."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    hidden, layers = text.hidden_size, text.num_hidden_layers
    rows = num_embedding_rows if num_embedding_rows is not None else text.vocab_size
    if config.hidden_size != hidden:
        raise ValueError(f"hidden_size is {config.hidden_size}, the target's is {hidden}")
    if config.vocab_size != rows:
        raise ValueError(f"vocab_size is {config.vocab_size}, the target's embedding has {rows} rows")
    if num_target_layers_given and config.num_target_layers != layers:
        raise ValueError(f"num_target_layers is {config.num_target_layers} (the target it was trained on), this "
                         f"target has {layers} layers")
    try:
        check_target_layer_ids(config.target_layer_ids, layers)
    except ValueError as e:
        raise ValueError(f"dflash_config.target_layer_ids: {e}") from None


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
