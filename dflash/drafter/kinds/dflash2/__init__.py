"""The DFlash2 drafter kind (z-lab's `DFlash2DraftModel`): a DFlash drafter with block-local dynamic
convolutions around every sublayer and a candidate selector (`network`), its settings as released
(`DFlash2Settings` in `dflash_config`), its layers (all sliding, not causal), the selector's loss term
and options, its logits' scale and softcap, and what its parts add to the memory plan and the FLOPs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash.drafter.config_format import SLIDING
from dflash.drafter.kinds import DrafterKind
from dflash.drafter.kinds.dflash2.network import (
    CandidateSelector,
    DFlash2Drafter,
    GroupedDynamicCausalConv,
    SelectorTerm,
    block_conv,
    selector_figures,
    unary_logits,
)
from dflash.options import Option

# The released DFlash2 drafters' attention: every layer sliding over this many positions, is_causal false.
SLIDING_WINDOW = 2048


@dataclass
class DFlash2Settings:
    """What a DFlash2 drafter adds (`DrafterConfig.kind_settings`): grouped dynamic causal convolutions of
    `conv_kernel_size` taps, one dynamic weight per `conv_group_size` channels, around each attention
    and MLP sublayer; a candidate selector over the top-`selector_top_k` unary logits with codebooks
    of `selector_rank`; unary logits = softcap(output_multiplier x lm_head(h)); noise embeddings x
    input_embedding_scale. Written to config.json's dflash_config, as the release keeps them."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None  # None: no softcap (0 reads as None, as the official class does)
    input_embedding_scale: float = 1.0

    def check(self, hidden_size: int, vocab_size: int) -> None:
        """Raise ValueError naming the dflash_config key that the official class and SGLang would not
        serve as this drafter computes it."""
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"dflash_config.{key} must be an integer >= 1 in a DFlash2 drafter, got {value!r}")
        if hidden_size % self.conv_group_size:
            raise ValueError(f"dflash_config.conv_group_size {self.conv_group_size} does not divide hidden_size "
                             f"{hidden_size} (the convolution's dynamic weights are per group of channels)")
        if self.selector_top_k > vocab_size:
            raise ValueError(f"dflash_config.selector_top_k {self.selector_top_k} exceeds the {vocab_size} "
                             "vocabulary rows")
        if not self.output_multiplier > 0:
            raise ValueError(f"dflash_config.output_multiplier must be > 0 (the selector's top-K and greedy drafts "
                             f"read the scaled logits), got {self.output_multiplier!r}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError(f"dflash_config.final_logit_softcapping must be > 0 or absent, got "
                             f"{self.final_logit_softcapping!r}")
        if not self.input_embedding_scale > 0:
            raise ValueError(f"dflash_config.input_embedding_scale must be > 0, got {self.input_embedding_scale!r}")

    def to_json_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                              "selector_top_k", "output_multiplier")}
        if self.final_logit_softcapping is not None:
            out["final_logit_softcapping"] = self.final_logit_softcapping
        if self.input_embedding_scale != 1.0:  # the release leaves it out (1.0 in the official loop)
            out["input_embedding_scale"] = self.input_embedding_scale
        return out

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> DFlash2Settings:
        """From a DFlash2 config.json (dflash_config first, then the top level, as the official class reads)."""
        dflash = d.get("dflash_config") or {}

        def pick(name, default=None):
            return dflash.get(name, d.get(name, default))

        missing = [k for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
                   if pick(k) is None]
        if missing:
            raise ValueError(f"config.json of a DFlash2DraftModel lacks dflash_config.{missing[0]} (the official class "
                             "requires it)")
        softcap = pick("final_logit_softcapping")
        return cls(conv_kernel_size=pick("conv_kernel_size"), conv_group_size=pick("conv_group_size"),
                   selector_rank=pick("selector_rank"), selector_top_k=pick("selector_top_k"),
                   output_multiplier=float(pick("output_multiplier", 1.0)),
                   final_logit_softcapping=float(softcap) if softcap else None,
                   input_embedding_scale=float(pick("input_embedding_scale", 1.0)))


def released_settings() -> DFlash2Settings:
    """The sizes of the released DFlash2 drafters (z-lab's fixture config), with the logits a DFlash
    drafter has (multiplier 1, no softcap: a new drafter starts as a DFlash one)."""
    return DFlash2Settings(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)


def row_flops(hidden: int, layers: int, block_size: int, settings: DFlash2Settings,
              selector_stop_grad: bool = False) -> float:
    """What a DFlash2 drafter adds per block row in training, forward and backward.

    Convolutions: each layer's two `kernel_projection`s (one before the attention, one before the
    MLP; H -> 2 K H/G, both convolutions' dynamic weights at once), trained and on the gradient's
    path (3x). Their taps are element-wise ((base + delta) x shifted input, summed: about 6 K H per
    pair and row forward, 1.5 G/H of the projection's, 0.6% at H 4096 and G 16) and not counted, as
    norms are not.
    Selector (`SelectorTerm`, on the B - 1 scored rows of a block): the hidden projection H -> R,
    its weight's gradient, and its input's unless `selector_stop_grad`; the transition scores over
    the K candidates (2 R K) and the gradients of both operands (the successor rows trained).
    The codebooks are looked up, not multiplied; the unary logits are the lm_head already priced."""
    H, K, G = hidden, settings.conv_kernel_size, settings.conv_group_size
    R, top_k = settings.selector_rank, settings.selector_top_k
    conv = layers * 2 * 3 * 2 * H * 2 * K * (H // G)
    selector = (2 if selector_stop_grad else 3) * 2 * H * R + 3 * 2 * R * top_k
    return conv + (block_size - 1) / block_size * selector


class DFlash2Kind(DrafterKind):
    name = "dflash2"
    title = "DFlash2"
    architecture = "DFlash2DraftModel"
    summary = ("adds grouped dynamic causal convolutions around every sublayer and a candidate selector (z-lab's "
               "DFlash2DraftModel, sized as released: kernel 2, groups of 16 channels, top-16 candidates, rank 256); "
               f"its layers default to the release's, all sliding over --sliding-window (default {SLIDING_WINDOW}) "
               "and not causal (is_causal false)")
    options = {
        "selector_weight": Option("loss", 1.0, "dflash2: weight of the selector's loss (K-way cross-entropy over "
                                  "the top-K candidates) against the DFlash cross-entropy",
                                  (lambda v: v >= 0, "must be >= 0")),
        "selector_stop_grad": Option("loss", False, "dflash2: the selector's loss trains the selector only (its "
                                     "gradient does not reach the drafter's layers)"),
    }
    # what a DFlash2DraftModel computes besides a DFlash drafter (`DFlash2Settings`), read from dflash_config first
    config_keys = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping", "conv_kernel_size",
                   "conv_group_size", "selector_rank", "selector_top_k")
    released_layer_type, released_window, released_is_causal = SLIDING, SLIDING_WINDOW, False
    may_softcap = True  # a released drafter may have one: the memory plan must not be low
    fused_head = True  # the selector reads the top-K and gold logits only (`SelectorTerm.head_top_k`)

    network = DFlash2Drafter

    def released_settings(self) -> DFlash2Settings:
        return released_settings()

    def small_settings(self, hidden_size: int, vocab_size: int) -> DFlash2Settings:
        """Kernel 2, groups of 16 channels, a selector of rank 8 over half the vocabulary's tokens (at most
        8): candidates often miss the gold token, so the residual and the selector's misses are exercised;
        logits scaled and softcapped, the noise embedding scaled, as a released drafter may have them."""
        return DFlash2Settings(conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                               selector_top_k=min(8, vocab_size // 2), output_multiplier=0.7,
                               final_logit_softcapping=4.0, input_embedding_scale=1.5)

    def read_settings(self, d: dict) -> DFlash2Settings:
        return DFlash2Settings.from_json_dict(d)

    def write_config(self, config, out: dict) -> None:
        # The release keeps every drafter setting in dflash_config (block_size included) and the
        # official class reads it there first.
        s = config.kind_settings
        # every key stated, a softcap of none as null, so that no engine falls back to a default of its own
        out["dflash_config"] = {"block_size": out.pop("block_size"), **out["dflash_config"], **s.to_json_dict(),
                                "final_logit_softcapping": s.final_logit_softcapping,
                                "input_embedding_scale": s.input_embedding_scale}

    def check_sizes(self, settings, hidden_size: int, vocab_size: int) -> None:
        settings.check(hidden_size, vocab_size)

    def check_settings(self, config) -> None:
        if not isinstance(config.kind_settings, DFlash2Settings):
            raise ValueError(f"a DFlash2 drafter needs its settings (DFlash2Settings), got {config.kind_settings!r}")
        config.kind_settings.check(config.hidden_size, config.vocab_size)

    def terms(self, drafter, loss_options) -> list:
        return [SelectorTerm(drafter.candidate_selector, self.option(loss_options, "selector_weight"),
                             self.option(loss_options, "selector_stop_grad"))]

    def logit_map(self, config) -> tuple[float, float | None]:
        s = config.kind_settings
        return s.output_multiplier, s.final_logit_softcapping

    def row_flops(self, hidden: int, layers: int, block_size: int, settings, loss_options, vocab: int = 0) -> float:
        return row_flops(hidden, layers, block_size, settings, self.option(loss_options, "selector_stop_grad"))

    def layer_params(self, settings, d) -> int:
        """Two block-convolution pairs (before and after each sublayer), each its base kernels and the kernel
        projection."""
        H, K = d.hidden, settings.conv_kernel_size
        return 2 * (2 * K * H + H * 2 * K * (H // settings.conv_group_size))

    def head_params(self, settings, d) -> int:
        """The selector's two codebooks over the vocabulary and its hidden projection."""
        return (2 * d.vocab + d.hidden) * settings.selector_rank

    def layer_row_bytes(self, settings, d, setup) -> int:
        """A layer's four block convolutions, per block row (`dflash.ops.block_conv` keeps only its inputs):
        the two after a sublayer keep its output (no other op saves it); the two before keep the normed
        input the kernel projection keeps too, their outputs remade in backward (`RecomputedConvOutputs`:
        the projections keep no copy); and the two kernel projections' outputs (the dynamic weights of both
        convolutions around a sublayer)."""
        K = settings.conv_kernel_size
        return setup.dtype_bytes * (2 * d.hidden + 2 * 2 * K * (d.hidden // settings.conv_group_size))

    def backward_row_bytes(self, settings, d, setup) -> int:
        """A block convolution's backward, one at a time: the Triton kernels' remade output and input
        gradient; the CPU's recomputing reference (CPU runs use the reference attention too) holds its whole
        graph a while, a factor and a shifted input per tap, and the output and gradients."""
        tensors = 2 * settings.conv_kernel_size + 3 if setup.attention == "reference" else 2
        return tensors * d.hidden * setup.dtype_bytes

    def loss_row_bytes(self, settings, d, setup) -> int:
        """The selector's loss (its B - 1 scored rows): the successor codebook's rows of the K candidates
        (saved, and their gradient in the backward, with every layer's activations still held), the
        predecessor's row, the hidden projection and their product, the top-K's values, ids and scores."""
        b, K, R = setup.dtype_bytes, settings.selector_top_k, settings.selector_rank
        return int((setup.block_size - 1) / setup.block_size * (b * (2 * K * R + 3 * R) + K * (4 + 8 + 4)))


KIND = DFlash2Kind()
__all__ = ["KIND", "SLIDING_WINDOW", "CandidateSelector", "DFlash2Drafter", "DFlash2Kind", "DFlash2Settings",
           "GroupedDynamicCausalConv", "SelectorTerm", "block_conv", "released_settings", "row_flops",
           "selector_figures", "unary_logits"]
