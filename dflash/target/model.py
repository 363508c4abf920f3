"""The frozen target model as a feature extractor: tapped hidden states on packed micro-batches.

`TargetModel.features(batch)` runs the target's own decoder layers (embedding, RoPE, layers
0..max(target_layer_ids)) and returns the residual stream after each tapped layer. Later layers,
the final norm and the lm_head never run.

Packed micro-batches (no padding) run attention through `dflash.ops.varlen_attention`, which is
registered with transformers' `AttentionInterface`, so the model's own attention modules
(projections, q/k norms, RoPE, GQA, latent attention) are used unchanged and only the attention
kernel differs: it takes the layer's sliding window and attention sinks (gpt-oss) and a value head
dim of its own (MLA). Gated DeltaNet layers (Qwen3.5/3.6) run their token mixer on the flat row
with the short convolution and the delta rule restarting at every sample (`dflash.ops`
gated_delta ops). MoE layers route every token of the flat row on its own, as they do in any
batch shape. Padded micro-batches run the same layers with the ordinary attention mask (SDPA by
default; a model transformers runs without SDPA, gpt-oss, uses its own eager attention, sinks
included).
"""
from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash.data.batch import PackedBatch, PaddedBatch
from dflash.errors import UserError
from dflash.target.spec import SUPPORTED_MODEL_TYPES, gguf_config
from dflash.target.taps import DEFAULT_NUM_TARGET_FEATURES, check_target_layer_ids, default_target_layer_ids


@dataclass(frozen=True)
class SharedWeights:
    """The target's frozen embedding and lm_head, lent to the drafter by reference.

    A plain holder, not an nn.Module: the drafter handed to DeepSpeed must own only its
    trainable parameters, so these never appear in its parameters() or state_dict().
    """

    embed: torch.Tensor  # (V, H)
    lm_head: torch.Tensor  # (V, H); the same tensor as embed for tied-embedding targets


def _varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    *,
    padded_implementation: str,
    **kwargs,
):
    """Hugging Face attention function: varlen on packed rows, the padded kernel otherwise.

    query (1, Hq, T, D), key/value (1, Hkv, T, D) when `cu_seq_lens_q` is given (packed);
    returns (1, T, Hq, D) as every transformers attention function does.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        if padded_implementation == "eager":  # the model's own (gpt-oss: with its sinks; mask from eager's maker)
            eager = sys.modules[type(module).__module__].eager_attention_forward
            return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        padded = ALL_ATTENTION_FUNCTIONS[padded_implementation]
        return padded(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                      sliding_window=sliding_window, **kwargs)
    sinks = kwargs.pop("s_aux", None)
    from dflash.ops import varlen_attention

    if query.shape[0] != 1:
        raise ValueError("packed attention expects one flat row of tokens")
    out = varlen_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu,
        kwargs["max_length_q"],
        causal=True,
        softmax_scale=scaling,
        window=sliding_window,
        sinks=sinks,
        backend=kwargs.get("attention_backend", "auto"),
        cu_seqlens_cpu=kwargs.get("cu_seqlens_cpu"),
    )
    return out.unsqueeze(0), None


def _is_gated_deltanet(module: nn.Module) -> bool:
    """A Qwen3.5-style Gated DeltaNet token mixer (transformers' Qwen3_5GatedDeltaNet and its MoE twin)."""
    return type(module).__name__.endswith("GatedDeltaNet") and all(
        hasattr(module, name) for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log",
                                           "dt_bias", "norm", "out_proj"))


def gated_deltanet_packed(module: nn.Module, hidden: torch.Tensor, cu_seqlens: torch.Tensor,
                          backend: str = "auto") -> torch.Tensor:
    """A Qwen3.5 Gated DeltaNet token mixer over one flat row of packed samples, (1, T, H) -> (1, T, H).

    The module's own weights and norm, in transformers' order: projections, the short causal
    convolution (restarting per sample), q/k/v heads, beta = sigmoid(b), log decay
    g = -exp(A_log) softplus(a + dt_bias), the delta rule from a zero state per sample (q/k
    l2-normalised), the gated RMS norm with z, the output projection. backend: "auto", "torch" or "fla".
    """
    from dflash.ops import causal_conv1d_varlen, gated_delta_rule_varlen

    x = hidden[0]
    t = x.shape[0]
    m = module
    mixed = causal_conv1d_varlen(m.in_proj_qkv(x), m.conv1d.weight.squeeze(1), m.conv1d.bias, cu_seqlens,
                                 m.activation, backend=backend)
    q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    beta = m.in_proj_b(x).sigmoid()
    g = -m.A_log.float().exp() * F.softplus(m.in_proj_a(x).float() + m.dt_bias)
    out = gated_delta_rule_varlen(q.reshape(t, -1, m.head_k_dim), k.reshape(t, -1, m.head_k_dim),
                                  v.reshape(t, -1, m.head_v_dim), g, beta, cu_seqlens, use_qk_l2norm=True,
                                  backend=backend)
    out = m.norm(out.reshape(-1, m.head_v_dim), m.in_proj_z(x).reshape(-1, m.head_v_dim))
    return m.out_proj(out.reshape(t, -1))[None]


def _install_packed_mixer(module: nn.Module) -> None:
    """Route `module`'s packed calls (those carrying cu_seq_lens_q, no cache) to gated_deltanet_packed;
    every other call (padded batches, decoding with a cache) runs transformers' forward unchanged."""
    if getattr(module, "_dflash_packed", False):
        return
    original = module.forward

    def forward(hidden_states, *args, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None or args or kwargs.get("cache") is not None:
            return original(hidden_states, *args, **kwargs)
        backend = "torch" if kwargs.get("attention_backend") == "torch" else "auto"
        return gated_deltanet_packed(module, hidden_states, cu, backend)

    module.forward = forward
    module._dflash_packed = True


@functools.cache
def register_varlen_attention(padded_implementation: str = "sdpa") -> str:
    """Register the dflash attention (and its mask function) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = padded_implementation in ALL_ATTENTION_FUNCTIONS or padded_implementation == "eager"
    if not known or padded_implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"padded_attn_implementation {padded_implementation!r} is not a registered transformers attention "
            f"with a mask function (e.g. 'sdpa', 'eager', 'flash_attention_2')"
        )
    # transformers reads "flash", "sdpa" and "flex_attention" in a name (case-sensitively) as a claim to be
    # that kernel (imports, support checks, MLA value padding): the padded one's name goes in upper case.
    name = f"packed_varlen+{padded_implementation.upper()}"
    AttentionInterface.register(
        name, functools.partial(_varlen_attention_forward, padded_implementation=padded_implementation)
    )
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[padded_implementation])
    return name


@functools.cache
def _mask_cache_keyword() -> str:
    """The mask functions' cache argument: `past_key_values` in older transformers (the GPU image's
    5.17), `cache` in newer ones."""
    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


class TargetModel(nn.Module):
    """A frozen Hugging Face causal LM that returns the hidden states of chosen layers.

    Args:
        model: an `AutoModelForCausalLM` of a family in TARGET_FAMILIES (dense, MoE, hybrid Gated
            DeltaNet, sliding window + sinks, MLA); for an image-text checkpoint, its language
            model (`load_language_model` loads only that).
        target_layer_ids: 0-indexed layers whose outputs are tapped (`hidden_states[id + 1]`
            of a Hugging Face forward), in the order they are concatenated. Default: the
            official rule with `num_features` taps. Ids >= L-1 are refused.
        num_features: K, used only when target_layer_ids is None.
        padded_attn_implementation: transformers attention used for padded micro-batches (and for
            decoding with this model); default "sdpa", or "eager" (the model's own) for a model
            transformers runs without SDPA (gpt-oss: its sinks).
        attention_backend: `dflash.ops` backend of the packed path ("auto", "triton", "torch").

    The model is frozen (requires_grad False), kept in eval mode, and run without grad.

    Example:
        target = TargetModel(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
        feats = target.features(batch)  # (tokens, K*H) in packed token order
    """

    def __init__(
        self,
        model: nn.Module,
        target_layer_ids: list[int] | None = None,
        *,
        num_features: int = DEFAULT_NUM_TARGET_FEATURES,
        padded_attn_implementation: str | None = None,
        attention_backend: str = "auto",
    ) -> None:
        super().__init__()
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            hint = ""
            if hasattr(config, "text_config"):
                hint = "; an image-text model: load its language model with dflash.models.load_language_model"
            raise ValueError(
                f"target model_type {config.model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES}){hint}"
            )
        num_layers = config.num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_layers, num_features)
        self.target_layer_ids = check_target_layer_ids(target_layer_ids, num_layers)
        self.model = model
        self.attention_backend = attention_backend
        model.requires_grad_(False)
        model.eval()
        # One registered implementation serves both layouts: packed calls carry cu_seq_lens_q.
        if padded_attn_implementation is None:
            padded_attn_implementation = "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"
        model.set_attn_implementation(register_varlen_attention(padded_attn_implementation))
        mixers = [m for m in model.modules() if _is_gated_deltanet(m)]
        linear = self._layer_types().count("linear_attention")
        if len(mixers) != linear:  # never run a linear-attention layer over a whole packed row
            raise ValueError(f"the target has {linear} linear-attention layers but {len(mixers)} Gated DeltaNet "
                             f"modules of the layout dflash knows (Qwen3.5's in_proj_qkv/z/b/a, conv1d, A_log, "
                             f"dt_bias, norm, out_proj); this transformers version's module is not supported")
        for module in mixers:
            _install_packed_mixer(module)

    @property
    def config(self):
        return self.model.config

    @property
    def num_embedding_rows(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

    def train(self, mode: bool = True) -> TargetModel:
        # Frozen: stays in eval mode whatever the caller asks.
        return super().train(False)

    def shared_weights(self) -> SharedWeights:
        """The frozen embedding and lm_head weights (by reference) for the drafter."""
        return SharedWeights(
            embed=self.model.get_input_embeddings().weight,
            lm_head=self.model.get_output_embeddings().weight,
        )

    @torch.no_grad()
    def features(self, batch: PackedBatch | PaddedBatch, *, with_output: bool = False):
        """Concatenated outputs of the tapped layers, `(tokens, K*H)`, in packed token order.
        `with_output`: also run the remaining layers and the final norm, and return
        `(features, output)` with the model's output states `(tokens, H)` (before the lm_head).

        Packed batch: one flat row, attention per sample through `dflash.ops.varlen_attention`
        (position_ids restart at 0 per sample, so RoPE sees in-sample positions).
        Padded batch: `(S, L)` rows through the ordinary attention mask; the result keeps only
        real tokens, row by row, i.e. the packed order of the same samples.
        No grad (not inference mode, so the drafter can use the features in autograd).
        """
        base = self.model.base_model
        if isinstance(batch, PackedBatch):
            input_ids = batch.input_ids[None]
            position_ids = batch.position_ids[None]
            mask_mapping = None
            extra = dict(
                cu_seq_lens_q=batch.cu_seqlens,
                cu_seq_lens_k=batch.cu_seqlens,
                max_length_q=batch.max_seqlen,
                max_length_k=batch.max_seqlen,
                cu_seqlens_cpu=batch.cu_seqlens_cpu,
                attention_backend=self.attention_backend,
            )
        else:
            input_ids, position_ids = batch.input_ids, batch.position_ids
            extra = {}
        hidden = base.embed_tokens(input_ids)
        if isinstance(batch, PaddedBatch):
            mask_mapping = self._padded_masks(hidden, batch.attention_mask, position_ids)
        position_embeddings = base.rotary_emb(hidden, position_ids)
        last = len(base.layers) - 1 if with_output else max(self.target_layer_ids)
        taps = {}
        layer_types = self._layer_types()
        for i, layer in enumerate(base.layers[: last + 1]):
            hidden = layer(
                hidden,
                attention_mask=None if mask_mapping is None else mask_mapping[layer_types[i]],
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                **extra,
            )
            if i in self.target_layer_ids:
                taps[i] = hidden
        out = torch.cat([taps[i] for i in self.target_layer_ids], dim=-1)
        if with_output:
            out = (out, base.norm(hidden))
        if isinstance(batch, PackedBatch):
            return tuple(x[0] for x in out) if with_output else out[0]
        real = batch.attention_mask.bool()
        return tuple(x[real] for x in out) if with_output else out[real]

    def _layer_types(self) -> list[str]:
        config = self.model.config
        types = getattr(config, "layer_types", None)
        if types:
            return list(types)
        # Llama/Mistral: one mask for all layers, sliding when the config has a window.
        kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
        return [kind] * config.num_hidden_layers

    def _padded_masks(self, hidden, attention_mask, position_ids) -> dict:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = dict(
            config=self.model.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            **{_mask_cache_keyword(): None},
            position_ids=position_ids,
        )
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in self._layer_types():
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        if "linear_attention" in self._layer_types():  # Gated DeltaNet: zeroes padded positions
            from transformers.masking_utils import create_recurrent_attention_mask

            masks["linear_attention"] = create_recurrent_attention_mask(**kwargs)
        return masks


def load_language_model(path, dtype: torch.dtype, device=None, gguf_file: str | None = None) -> nn.Module:
    """The target's causal LM from a Hugging Face folder (or the `gguf_file` in it, dequantized to
    `dtype`), without what features never use.

    An image-text checkpoint (Qwen3.5 / 3.6 ship as `...ForConditionalGeneration`) loads only its
    language model (`...ForCausalLM` on the nested text config): no vision tower in memory, the
    same decoder layers, so the same tapped layer ids. Raises when a weight of that language model
    is missing from the checkpoint instead of leaving it random.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    path = str(path)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    if gguf_file:  # its config as the spec read it, given to transformers: each reading parses all its metadata
        config = gguf_config(Path(path), gguf_file, "--target", str(Path(path) / gguf_file))
        extra["config"] = config
    else:
        config = AutoConfig.from_pretrained(path)
    text = config.get_text_config(decoder=True)
    if text is config:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    else:
        if type(text) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise UserError(f"{path}: {config.model_type} nests a {text.model_type} language model that transformers "
                            f"has no causal LM class for")
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(text)]
        model, info = cls.from_pretrained(path, config=text, dtype=dtype, output_loading_info=True)
        if info["missing_keys"]:
            missing = sorted(info["missing_keys"])
            raise UserError(f"{path}: the checkpoint lacks {len(missing)} weights of its language model "
                            f"{cls.__name__} (e.g. {', '.join(missing[:3])})")
    return model if device is None else model.to(device)

