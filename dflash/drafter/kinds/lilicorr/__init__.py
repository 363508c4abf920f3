"""The LiLiCorr drafter kind (`LiLiCorrDraftModel`, NVIDIA's candidate-lattice correlator over a DFlash
backbone): the network (`network`), its settings as released (`LiLiCorrSettings`, in `dflash_config`
as vLLM 0.32 reads them), the correlator's loss term and options (ModelOpt PR 2342's objective), and
what it adds to the FLOPs.

Engine matched: vLLM 0.32 (`model_executor/models/lilicorr.py`: `LiLiCorrForCausalLM`, its
`LiLiCorrHead` and `load_weights`; `v1/worker/gpu/spec_decode/lilicorr/speculator.py`, a subclass of
the DFlash2 speculator whose candidate walk it shares). The plain recipe is built (ModelOpt's
`lilicorr.yaml`); the variant with DFlash2's convolutions (`conv_kernel_size` > 0) is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from dflash.drafter.kinds import DrafterKind
from dflash.drafter.kinds.lilicorr.network import (
    NUM_FEATURES,
    LatticeCorrelator,
    LatticeTerm,
    LiLiCorrDrafter,
    lattice_figures,
    walk,
)
from dflash.options import Option

PREFIX = "lilicorr_"  # of every setting's dflash_config key
CONV_KEYS = ("conv_kernel_size", "conv_group_size")  # vLLM: both 0 is the plain drafter built here


@dataclass
class LiLiCorrSettings:
    """What a LiLiCorr drafter adds (`DrafterConfig.kind_settings`): the correlator's width (0: the
    drafter's hidden size), layers, attention heads, MLP ratio, the top-K candidates per slot, the
    factor width, the factors' L2 eps and the scale of their cosines. Written to config.json's
    dflash_config as `lilicorr_<field>`, with `lilicorr_enabled` true and no convolutions."""

    candidate_topk: int
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_ratio: float
    factor_dim: int
    vector_eps: float
    logit_scale: float

    def check(self, hidden_size: int, vocab_size: int, block_size: int | None = None) -> None:
        """Raise ValueError naming the dflash_config key vLLM 0.32 would not serve as computed here."""
        for key in ("candidate_topk", "num_layers", "num_heads", "factor_dim"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"dflash_config.{PREFIX}{key} must be an integer >= 1, got {value!r}")
        k = self.candidate_topk
        if k > 16 or k & (k - 1) or k > vocab_size:
            raise ValueError(f"dflash_config.{PREFIX}candidate_topk must be a power of two <= 16 and <= the "
                             f"vocabulary ({vocab_size}), got {k}")
        h = self.hidden_size
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(f"dflash_config.{PREFIX}hidden_size must be an integer >= 0 (0: the drafter's), "
                             f"got {h!r}")
        if (h or hidden_size) % self.num_heads:
            raise ValueError(f"dflash_config.{PREFIX}num_heads {self.num_heads} does not divide the correlator's "
                             f"width {h or hidden_size}")
        if not int((h or hidden_size) * self.mlp_ratio) >= 1:
            raise ValueError(f"dflash_config.{PREFIX}mlp_ratio must give an MLP of >= 1 channel, "
                             f"got {self.mlp_ratio!r}")
        if not 0 < self.vector_eps < 0.5:
            raise ValueError(f"dflash_config.{PREFIX}vector_eps must be in (0, 0.5), got {self.vector_eps!r}")
        if not self.logit_scale > 0:
            raise ValueError(f"dflash_config.{PREFIX}logit_scale must be > 0, got {self.logit_scale!r}")
        if block_size is not None and block_size < 2:
            raise ValueError(f"dflash_config.block_size must be >= 2 in a LiLiCorr drafter, got {block_size}")

    def to_json_dict(self) -> dict[str, Any]:
        return {"lilicorr_enabled": True, **{PREFIX + f.name: getattr(self, f.name) for f in fields(self)},
                **dict.fromkeys(CONV_KEYS, 0)}

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> LiLiCorrSettings:
        """From a LiLiCorr config.json (dflash_config first, then the top level); vLLM requires every key."""
        dflash = d.get("dflash_config") or {}

        def pick(name, default=None):
            return dflash.get(name, d.get(name, default))

        if not pick("lilicorr_enabled", True):
            raise ValueError("config.json sets dflash_config.lilicorr_enabled false (vLLM refuses it)")
        for key in CONV_KEYS:
            if pick(key, 0):
                raise ValueError(f"config.json sets dflash_config.{key} = {pick(key)!r}: the LiLiCorr drafter with "
                                 "DFlash2's convolutions is not implemented here (supported: 0)")
        missing = [f.name for f in fields(cls) if pick(PREFIX + f.name) is None]
        if missing:
            raise ValueError(f"config.json of a LiLiCorrDraftModel lacks dflash_config.{PREFIX}{missing[0]} "
                             "(vLLM requires it)")
        floats = {"mlp_ratio", "vector_eps", "logit_scale"}
        return cls(**{f.name: float(pick(PREFIX + f.name)) if f.name in floats else pick(PREFIX + f.name)
                      for f in fields(cls)})


def released_settings() -> LiLiCorrSettings:
    """The published recipe's correlator (ModelOpt `lilicorr.yaml`, Qwen3-8B): top-8 candidates, width
    1024, 2 layers of 8 heads, MLP ratio 2, factors of 1024, eps 1e-4, scale 8."""
    return LiLiCorrSettings(candidate_topk=8, hidden_size=1024, num_layers=2, num_heads=8, mlp_ratio=2.0,
                            factor_dim=1024, vector_eps=1e-4, logit_scale=8.0)


def head_parameters(settings: LiLiCorrSettings, hidden: int, block_size: int) -> int:
    """The correlator's parameter count (what `LatticeCorrelator` holds)."""
    s = settings
    h, K, F_, L, r = s.hidden_size or hidden, s.candidate_topk, s.factor_dim, s.num_layers, int(
        (s.hidden_size or hidden) * s.mlp_ratio)
    linear = lambda i, o: i * o + o  # noqa: E731
    layer = 2 * h + 3 * h * h + 3 * h + linear(h, h) + linear(h, r) + linear(r, h)
    return ((linear(hidden, h) if h != hidden else 0) + linear(hidden, h) + 2 * NUM_FEATURES
            + linear(NUM_FEATURES, h) + linear(h, h) + (block_size - 1) * h + K * h
            + s.num_heads * (2 * block_size - 1) + s.num_heads + linear(hidden, h) + L * layer + 2 * h
            + linear(3 * h, h) + 3 * linear(h, F_))


def row_flops(hidden: int, layers: int, block_size: int, settings: LiLiCorrSettings, penalty: bool = True,
              logprob_grad: bool = True, vocab: int = 0) -> float:
    """What a LiLiCorr drafter adds per block row in training, forward and backward.

    Per block the lattice holds (B - 1) K positions; each runs the candidate projections (token_proj
    where the widths differ, the feature MLP 5 -> h -> h; pass_hidden_proj once per slot), every
    layer's attention projections (4 h^2) and MLP (2 r h), attention over the L = (B - 1) K positions
    (2 L h for the scores, 2 L h for the values), factor_input_proj (3 h^2) and the two factor heads
    (2 h F); per block the anchor's context_proj and anchor_out_head; the pair scores (B - 2) K^2 F.
    Everything is trained and on the gradient's path (3x its multiply-adds x 2) but token_proj, whose
    input (the target's embeddings) takes no gradient (2x). The context rows are gathered from the
    backbone's fused context (no FLOPs of their own). With the gradient through the candidates'
    log-probabilities (`logprob_grad`), each scored row's softmax times the lm_head (2 V H, `vocab`) and
    its K candidates' rows times their gradients (2 K H). The penalty (`penalty`) reads the target's
    logits of the candidates, (B - 1) K dot products of H per block, forward only. Norms, the features
    and the walk are not counted."""
    s = settings
    H, B, K, F_ = hidden, block_size, s.candidate_topk, s.factor_dim
    h = s.hidden_size or H
    r, S = int(h * s.mlp_ratio), B - 1
    lattice = S * K
    per_candidate = (NUM_FEATURES * h + h * h
                     + s.num_layers * (4 * h * h + 2 * r * h + 2 * lattice * h) + 3 * h * h + 2 * h * F_)
    per_block = lattice * per_candidate + S * H * h + H * h + h * F_ + (S - 1) * K * K * F_
    # the candidates' embeddings are the target's, frozen: token_proj has no input gradient (2x)
    trained = 3 * 2 * per_block + 2 * 2 * lattice * (H * h if h != H else 0)
    target = 2 * lattice * H if penalty else 0
    # d log p(c) / d h: each scored row's softmax times the lm_head (E_p[W], in the lm_head pass) and the
    # product of the candidates' gradients with their lm_head rows
    logprob = 2 * S * (vocab * H + K * H) if logprob_grad else 0
    return (trained + target + logprob) / B


class LiLiCorrKind(DrafterKind):
    name = "lilicorr"
    title = "LiLiCorr"
    architecture = "LiLiCorrDraftModel"
    summary = ("adds a candidate-lattice correlator over the drafter's top candidates and drafts the path it "
               "walks (NVIDIA's LiLiCorr, as vLLM 0.32 serves LiLiCorrDraftModel; sized as released: top-8, "
               "width 1024, 2 layers, factors of 1024, scale 8)")
    options = {
        "lilicorr_ce_weight": Option("loss", 0.25, "lilicorr: weight of the lattice's cross-entropy over each slot's "
                                     "K candidates along the data's path", (lambda v: v >= 0, "must be >= 0")),
        "lilicorr_margin_weight": Option("loss", 0.0, "lilicorr: weight of the hinge relu(margin - (gold score - "
                                         "best other)) (ModelOpt's margin variant: 0.125, with ce 0.125)",
                                         (lambda v: v >= 0, "must be >= 0")),
        "lilicorr_penalty_weight": Option("loss", 0.25, "lilicorr: weight of the distractor penalty, the lattice's "
                                          "expected target-logit gap to the gold token (runs the target to its "
                                          "final norm)", (lambda v: v >= 0, "must be >= 0")),
        "lilicorr_margin": Option("loss", 2.0, "lilicorr: the hinge's margin in score units",
                                  (lambda v: v > 0, "must be > 0")),
        "lilicorr_logprob_grad": Option("loss", True, "lilicorr: the lattice's gradient reaches the backbone "
                                        "through the candidates' log-probabilities too (as ModelOpt trains; "
                                        "off: they are detached inputs and a GPU may run the fused head)"),
    }
    # its lilicorr_* keys are ones no DFlash check refuses, and it computes no convolutions (0, as DFlash)
    config_keys = ()
    # the lattice reads only the top-K and the log-sum-exp where its log-probabilities are detached
    # (--no-lilicorr-logprob-grad); by default it reads the chunk's softmax: the plan prices the plain pass
    fused_head = False

    network = LiLiCorrDrafter

    def released_settings(self) -> LiLiCorrSettings:
        return released_settings()

    def read_settings(self, d: dict) -> LiLiCorrSettings:
        return LiLiCorrSettings.from_json_dict(d)

    def write_config(self, config, out: dict) -> None:
        # vLLM reads the block size from dflash_config first, as for DFlash2
        out["dflash_config"] = {"block_size": out.pop("block_size"), **out["dflash_config"],
                                **config.kind_settings.to_json_dict()}

    def check_sizes(self, settings, hidden_size: int, vocab_size: int) -> None:
        settings.check(hidden_size, vocab_size)

    def check_settings(self, config) -> None:
        if not isinstance(config.kind_settings, LiLiCorrSettings):
            raise ValueError(f"a LiLiCorr drafter needs its settings (LiLiCorrSettings), got {config.kind_settings!r}")
        config.kind_settings.check(config.hidden_size, config.vocab_size, config.block_size)

    def terms(self, drafter, loss_options) -> list:
        o = lambda name: self.option(loss_options, name)  # noqa: E731
        return [LatticeTerm(drafter, o("lilicorr_ce_weight"), o("lilicorr_margin_weight"),
                            o("lilicorr_penalty_weight"), o("lilicorr_margin"), o("lilicorr_logprob_grad"))]

    def small_settings(self, hidden_size: int, vocab_size: int) -> LiLiCorrSettings:
        """Top-4 candidates (a vocabulary of 4 holds them), a correlator half the drafter's width (so
        token_proj is built), one layer of 2 heads, factors of 8."""
        return LiLiCorrSettings(candidate_topk=4, hidden_size=hidden_size // 2, num_layers=1, num_heads=2,
                                mlp_ratio=2.0, factor_dim=8, vector_eps=1e-4, logit_scale=6.0)

    def term_costs(self, loss_options) -> tuple[list[int], bool]:
        # as LatticeTerm: the log-sum-exp's exponentials, and the softmax's product with the lm_head
        # where the gradient reaches the log-probabilities; the penalty reads the target's logits
        return ([1 + bool(self.option(loss_options, "lilicorr_logprob_grad"))],
                self.option(loss_options, "lilicorr_penalty_weight") > 0)

    def row_flops(self, hidden: int, layers: int, block_size: int, settings, loss_options, vocab: int = 0) -> float:
        # the penalty's target logits ((B - 1) K dot products of H per block, forward only) are left out:
        # a step without the target's final states skips them, and they are < 1% of the correlator's
        return row_flops(hidden, layers, block_size, settings, False,
                         bool(self.option(loss_options, "lilicorr_logprob_grad")), vocab)

    def head_params(self, settings, d) -> int:
        return head_parameters(settings, d.hidden, d.block_size)

    # The correlator runs in the loss (`LatticeTerm.finish`) over (B - 1) K lattice positions per block;
    # per position it saves for backward the candidate's embedding (token_proj's input, where the widths
    # differ), the feature MLP's two activations (2 h), per layer its norms' inputs and outputs, q, k, v,
    # the attention's output and probabilities over the block's lattice, the MLP's two (7 h + 2 r + heads
    # L), and the factor path's (the output norm's input and output, the concatenation, the projection
    # and its SiLU, the two factors and their unit vectors: 7 h + 4 F). Per label row the lm_head pass
    # keeps the top-K values and ids, the log-sum-exp and the expected lm_head row (float32; counted
    # whether or not the gradient reaches the log-probabilities).
    def loss_row_bytes(self, settings, d, setup) -> int:
        s, B, H = settings, setup.block_size, d.hidden
        h = s.hidden_size or H
        lattice = (B - 1) * s.candidate_topk
        per_position = ((H if h != H else 0) + 2 * h + 7 * h + 4 * s.factor_dim
                        + s.num_layers * (7 * h + 2 * int(h * s.mlp_ratio) + s.num_heads * lattice))
        return int(lattice / B * setup.dtype_bytes * per_position)

    def term_row_bytes(self, settings, d, setup) -> int:
        B = setup.block_size
        return int((B - 1) / B * (12 * settings.candidate_topk + 4 + 4 * d.hidden))


KIND = LiLiCorrKind()
__all__ = ["KIND", "LatticeCorrelator", "LatticeTerm", "LiLiCorrDrafter", "LiLiCorrKind", "LiLiCorrSettings",
           "head_parameters", "lattice_figures", "released_settings", "row_flops", "walk"]
