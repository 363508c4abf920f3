"""The frozen target model as a feature extractor: tapped hidden states on packed micro-batches.

`TargetModel.features(batch)` runs the target's own decoder layers (embedding, RoPE, layers
0..max(target_layer_ids)) and returns the residual stream after each tapped layer. Later layers,
the final norm and the lm_head never run.

Packed micro-batches (no padding) run attention through `dflash.ops.varlen_attention`, which is
registered with transformers' `AttentionInterface`, so the model's own attention modules
(projections, q/k norms, RoPE, GQA) are used unchanged and only the attention kernel differs.
Padded micro-batches run the same layers with the ordinary attention mask (SDPA by default).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from dflash.data.batch import PackedBatch, PaddedBatch
from dflash.models.config import DEFAULT_NUM_TARGET_FEATURES, check_target_layer_ids, default_target_layer_ids

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")


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
        padded = ALL_ATTENTION_FUNCTIONS[padded_implementation]
        return padded(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                      sliding_window=sliding_window, **kwargs)
    from dflash.ops import varlen_attention

    max_seqlen = kwargs["max_length_q"]
    if sliding_window is not None and max_seqlen > sliding_window:
        raise NotImplementedError(
            f"packed target features do not implement sliding-window attention (window {sliding_window}, "
            f"longest sample {max_seqlen}); use a padded micro-batch or shorter samples"
        )
    if query.shape[0] != 1:
        raise ValueError("packed attention expects one flat row of tokens")
    out = varlen_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu,
        max_seqlen,
        causal=True,
        softmax_scale=scaling,
        backend=kwargs.get("attention_backend", "auto"),
        cu_seqlens_cpu=kwargs.get("cu_seqlens_cpu"),
    )
    return out.unsqueeze(0), None


@functools.cache
def register_varlen_attention(padded_implementation: str = "sdpa") -> str:
    """Register the dflash attention (and its mask function) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if padded_implementation not in ALL_ATTENTION_FUNCTIONS or \
            padded_implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"padded_attn_implementation {padded_implementation!r} is not a registered transformers attention "
            f"with a mask function (e.g. 'sdpa', 'flash_attention_2')"
        )
    # No "flash" in the name: transformers would take it for a flash-attn kernel to import.
    name = f"packed_varlen+{padded_implementation}"
    AttentionInterface.register(
        name, functools.partial(_varlen_attention_forward, padded_implementation=padded_implementation)
    )
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[padded_implementation])
    return name


class TargetModel(nn.Module):
    """A frozen Hugging Face causal LM that returns the hidden states of chosen layers.

    Args:
        model: an `AutoModelForCausalLM` of the Qwen3, Qwen2, Llama or Mistral family.
        target_layer_ids: 0-indexed layers whose outputs are tapped (`hidden_states[id + 1]`
            of a Hugging Face forward), in the order they are concatenated. Default: the
            official rule with `num_features` taps. Ids >= L-1 are refused.
        num_features: K, used only when target_layer_ids is None.
        padded_attn_implementation: transformers attention used for padded micro-batches.
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
        padded_attn_implementation: str = "sdpa",
        attention_backend: str = "auto",
    ) -> None:
        super().__init__()
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"target model_type {config.model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
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
        model.set_attn_implementation(register_varlen_attention(padded_attn_implementation))

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
            cache=None,
            position_ids=position_ids,
        )
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in self._layer_types():
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks
