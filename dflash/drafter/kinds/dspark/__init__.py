"""The DSpark drafter kind (vLLM 0.32's `Qwen3DSparkModel`, DeepSeek's DeepSpec DSpark): a DFlash backbone
drafting a block in one parallel pass with the anchor as its first prediction, a low-rank Markov head
sampled left to right and a per-position confidence head (`network`); its settings (`DSparkSettings`,
top-level config.json keys as vLLM 0.32 reads them), its loss terms and options (the authors' CE + TV +
confidence BCE), and what its heads add to the memory plan and the FLOPs.

Matched engine: vLLM 0.32 (`model_executor/models/qwen3_dspark.py`, `v1/worker/gpu/spec_decode/dspark/`,
`config/speculative.py`): `architectures` ["Qwen3DSparkModel"], `block_size` the number of query rows and
drafts (vLLM's default `num_speculative_tokens`), `sample_from_anchor` true, `markov_rank`,
`markov_head_type` "vanilla", `enable_confidence_head`, `confidence_head_with_markov`, the mask token and
the tapped layers both top-level and in `dflash_config` (the dense DSpark configs' and DFlash's places,
the same indexing).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash.drafter.kinds import DrafterKind
from dflash.drafter.kinds.dspark.network import (
    ConfidenceHead,
    ConfidenceTerm,
    DSparkDrafter,
    MarkovHead,
    MarkovTerm,
    markov_buffers,
    markov_figures,
    markov_logits,
    previous_tokens,
)
from dflash.options import Option

ARCHITECTURE = "Qwen3DSparkModel"
MARKOV_HEAD_TYPES = ("vanilla",)  # vLLM 0.32's Qwen3 DSpark serves the vanilla head only


@dataclass
class DSparkSettings:
    """What a DSpark drafter adds (`DrafterConfig.kind_settings`): a Markov head of rank `markov_rank`
    and, with `enable_confidence_head`, a confidence head reading the hidden state (and, with
    `confidence_head_with_markov`, the Markov embedding). Written top-level in config.json."""

    markov_rank: int
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    markov_head_type: str = "vanilla"

    def check(self) -> None:
        """Raise ValueError naming the config.json key vLLM would not serve as this drafter computes it."""
        r = self.markov_rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"markov_rank must be an integer >= 1 in a DSpark drafter, got {r!r}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type {self.markov_head_type!r}: this drafter computes "
                             f"{', '.join(MARKOV_HEAD_TYPES)} only")
        for key in ("enable_confidence_head", "confidence_head_with_markov"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be true or false, got {getattr(self, key)!r}")

    def to_json_dict(self) -> dict[str, Any]:
        return {"markov_rank": self.markov_rank, "markov_head_type": self.markov_head_type,
                "enable_confidence_head": self.enable_confidence_head,
                "confidence_head_with_markov": self.confidence_head_with_markov,
                "sample_from_anchor": True, "dspark_bonus_anchor": False}

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> DSparkSettings:
        """From a DSpark config.json (top level, as vLLM reads it; vLLM's defaults where a key is absent)."""
        if d.get("markov_rank") is None:
            raise ValueError("config.json of a Qwen3DSparkModel lacks markov_rank (vLLM requires it)")
        if d.get("sample_from_anchor", True) is not True or d.get("dspark_bonus_anchor", False) is not False:
            raise ValueError("config.json sets sample_from_anchor false (the 1 + N fill-in layout); this drafter "
                             "computes the anchor-as-first-prediction layout only (sample_from_anchor true)")
        return cls(markov_rank=d["markov_rank"], enable_confidence_head=d.get("enable_confidence_head", False),
                   confidence_head_with_markov=d.get("confidence_head_with_markov", False),
                   markov_head_type=d.get("markov_head_type", "vanilla"))


def released_settings() -> DSparkSettings:
    """A new DSpark drafter's heads: rank 256 and the confidence head on the Markov embedding too
    (speculators' and TensorRT-LLM's defaults)."""
    return DSparkSettings(markov_rank=256)


def row_flops(vocab: int, hidden: int, block_size: int, settings: DSparkSettings) -> float:
    """What a DSpark drafter's heads add per block row in training, forward and backward, on its B - 1
    scored rows: the Markov bias (an r x V product) and its two gradients (the embedding's and
    markov_w2's), 2 r V each; the confidence head's projection forward and its weight's gradient (it reads
    detached inputs). The embedding is looked up, not multiplied. The backbone's one query row fewer per
    block (`DSparkKind.query_rows`) is left to the cost model, which prices B rows: an upper bound."""
    r = settings.markov_rank
    confidence = 2 * 2 * (hidden + r) if settings.enable_confidence_head else 0
    return (block_size - 1) / block_size * (3 * 2 * r * vocab + confidence)


class DSparkKind(DrafterKind):
    name = "dspark"
    title = "DSpark"
    architecture = ARCHITECTURE
    summary = ("a DFlash backbone whose anchor is the first prediction (B - 1 query rows for B - 1 drafts), a "
               "low-rank Markov head sampled left to right (rank 256) and a confidence head (vLLM's "
               "Qwen3DSparkModel); trained with the authors' CE + TV + confidence objective")
    options = {
        "dspark_ce_weight": Option("loss", 0.1, "dspark: weight of the cross-entropy of the Markov-biased logits",
                                   (lambda v: v >= 0, "must be >= 0")),
        "dspark_tv_weight": Option("loss", 0.9, "dspark: weight of the total variation between the Markov-biased "
                                   "softmax and the target's (the target runs to its final states)",
                                   (lambda v: v >= 0, "must be >= 0")),
        "dspark_confidence_weight": Option("loss", 1.0, "dspark: weight of the confidence head's binary "
                                           "cross-entropy against 1 - TV", (lambda v: v >= 0, "must be >= 0")),
    }
    config_keys = ()  # its keys are top-level ones no DFlash check refuses
    vllm_method = "dspark"  # vLLM's own DSpark speculator (qwen3_dspark.py)

    network = DSparkDrafter

    def released_settings(self) -> DSparkSettings:
        return released_settings()

    def small_settings(self, hidden_size: int, vocab_size: int) -> DSparkSettings:
        """Rank 8 with both heads: the Markov bias and the confidence head exercised at a test's size."""
        return DSparkSettings(markov_rank=8)

    def read_settings(self, d: dict) -> DSparkSettings:
        return DSparkSettings.from_json_dict(d)

    def write_config(self, config, out: dict) -> None:
        # vLLM drafts `block_size` query rows (num_speculative_tokens), the anchor the first: B - 1 here
        out["block_size"] = config.block_size - 1
        out.update(config.kind_settings.to_json_dict())
        out["target_layer_ids"] = list(config.target_layer_ids)
        out["mask_token_id"] = config.mask_token_id

    def read_block_size(self, written: int) -> int:
        return written + 1

    def query_rows(self, block_size: int) -> int:
        return block_size - 1

    def check_settings(self, config) -> None:
        if not isinstance(config.kind_settings, DSparkSettings):
            raise ValueError(f"a DSpark drafter needs its settings (DSparkSettings), got {config.kind_settings!r}")
        config.kind_settings.check()

    def check_sizes(self, settings, hidden_size: int, vocab_size: int) -> None:
        settings.check()

    def terms(self, drafter, loss_options) -> list:
        markov = MarkovTerm(drafter.markov_head, ce_weight=self.option(loss_options, "dspark_ce_weight"),
                            tv_weight=self.option(loss_options, "dspark_tv_weight"), lm_head=drafter.lm_head)
        weight = self.option(loss_options, "dspark_confidence_weight")
        if drafter.confidence_head is None or not weight:
            return [markov]
        return [markov, ConfidenceTerm(drafter.confidence_head, markov, weight)]

    def term_costs(self, loss_options) -> tuple[list[int], bool]:
        tv = self.option(loss_options, "dspark_tv_weight") > 0
        return [markov_buffers(tv)], tv

    def row_flops(self, hidden: int, layers: int, block_size: int, settings, loss_options, vocab: int = 0) -> float:
        return row_flops(vocab, hidden, block_size, settings)

    # The low-rank pair of V x r tables and the confidence head's H (+ r) weights and bias; per scored row
    # the Markov embedding, its bias and gradient (3 r). The Markov term holds markov_w2's float32 copy
    # and its gradient's accumulator (2 V r x 4 bytes), and per scored row the embedding and its
    # gradient (2 r x 4) and its CE, TV and hit (12 bytes).
    def head_params(self, settings, d) -> int:
        r = settings.markov_rank
        confidence = d.hidden + 1 + (r if settings.confidence_head_with_markov else 0)
        return 2 * d.vocab * r + (confidence if settings.enable_confidence_head else 0)

    def loss_row_bytes(self, settings, d, setup) -> int:
        return int((setup.block_size - 1) / setup.block_size * setup.dtype_bytes * 3 * settings.markov_rank)

    def term_bytes(self, settings, d, setup) -> int:
        return 2 * d.vocab * settings.markov_rank * 4

    def term_row_bytes(self, settings, d, setup) -> int:
        return 2 * settings.markov_rank * 4 + 12

KIND = DSparkKind()
__all__ = ["ARCHITECTURE", "KIND", "ConfidenceHead", "ConfidenceTerm", "DSparkDrafter", "DSparkKind",
           "DSparkSettings", "MarkovHead", "MarkovTerm", "markov_buffers", "markov_figures", "markov_logits",
           "previous_tokens", "released_settings", "row_flops"]
