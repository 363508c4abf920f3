"""A test-only drafter kind, written as a kind of one's own would be: the DFlash drafter whose layers
scale their attention output by a learned gate per channel, with the gate's starting value in its
config.json, an option (it joins the training options as the kind registers, whenever that is),
and a loss term of its own that reports a figure. Run as a
script it is `launch/train.py` with this kind known (`--drafter-kind gated`)."""
from __future__ import annotations

import runpy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflash.drafter.kinds import DrafterKind, Option, register
from dflash.drafter.network import DFlashDrafter
from dflash.objective.loss import Finished, LogitTerm


@dataclass(frozen=True)
class GateSettings:
    gate_init: float = 1.0


class GatedLayer(nn.Module):
    """A DFlash decoder layer's modules, its attention output times `attention_gate`."""

    def __init__(self, layer, hidden_size: int, gate_init: float) -> None:
        super().__init__()
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.attention_gate = nn.Parameter(torch.full((hidden_size,), gate_init))

    def forward(self, x, ctx, rope_blk, rope_ctx, seqlens, anchors, cache=None):
        attention = self.self_attn(self.input_layernorm(x), ctx, rope_blk, rope_ctx, seqlens, anchors, cache)
        x = x + attention * self.attention_gate.to(attention.dtype)
        return x + self.mlp(self.post_attention_layernorm(x))


class GatedDrafter(DFlashDrafter):
    def __init__(self, config, shared=None, **kwargs) -> None:
        super().__init__(config, shared, **kwargs)
        for i, layer in enumerate(self.layers):
            self.layers[i] = GatedLayer(layer, config.hidden_size, config.kind_settings.gate_init)


class ScoredRows(LogitTerm):
    """Weighs nothing; counts the scored rows, and names their share per block."""

    name = "scored_rows"
    vocab_buffers = 0
    metric_names = ("scored_rows",)

    def chunk(self, logits, lo, hi, need_grad):
        return logits.new_zeros(()), None

    def finish(self, hidden, blocks, temperatures):
        return Finished(hidden.new_zeros((), dtype=torch.float32), {"scored_rows": blocks.valid.sum().float()})

    def figures(self, sums: dict, blocks: float) -> dict:
        return {"scored_per_block": float(sums["scored_rows"]) / blocks if blocks else 0.0}


class GatedKind(DrafterKind):
    name = "gated"
    title = "gated DFlash"
    architecture = "GatedDFlashDraftModel"
    summary = "a test-only kind: a learned gate on every layer's attention output"
    network = GatedDrafter
    options = {"count_scored_rows": Option("loss", True, "gated: count the scored rows (a figure of the kind)")}

    def released_settings(self) -> GateSettings:
        return GateSettings()

    def read_settings(self, d: dict) -> GateSettings:
        return GateSettings(float(d["dflash_config"]["attention_gate_init"]))

    def write_config(self, config, out: dict) -> None:
        out["dflash_config"]["attention_gate_init"] = config.kind_settings.gate_init

    def check_settings(self, config) -> None:
        if not isinstance(config.kind_settings, GateSettings):
            raise ValueError(f"a gated drafter needs its GateSettings, got {config.kind_settings!r}")

    def terms(self, drafter, loss_options) -> list:
        return [ScoredRows(0.0)] if self.option(loss_options, "count_scored_rows") else []

    def layer_params(self, settings, d) -> int:
        return d.hidden  # the gate

    def layer_row_bytes(self, settings, d, setup) -> int:
        return setup.dtype_bytes * d.hidden  # the attention output, which the gate's product saves


KIND = register(GatedKind())

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "launch" / "train.py"), run_name="__main__")
