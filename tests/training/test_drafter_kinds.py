"""Drafter kinds are plug-ins: a kind of one's own (`gated_kind.py`, registered there and nowhere else)
trains, exports, reloads and decodes as the built-in ones do."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dflash.decoding.speculate import greedy_decode, speculative_decode
from dflash.drafter.kinds import architectures, drafter_kind
from dflash.models import DFlashDrafter, TargetModel
from dflash.testing import train_in_process

from . import gated_kind
from .conftest import read_metrics, tiny_train_args


def test_a_registered_kind_is_found_by_name_and_architecture_and_clashes_are_refused():
    assert drafter_kind("gated") is gated_kind.KIND and "GatedDFlashDraftModel" in architectures()
    with pytest.raises(ValueError, match="clashes with 'gated'"):
        from dflash.drafter.kinds import register

        register(type("Again", (gated_kind.GatedKind,), {})())
    with pytest.raises(ValueError, match=r"unknown drafter kind 'nope' \(known: dflash, dflash2, .*gated"):
        drafter_kind("nope")


@pytest.mark.slow
def test_a_kind_of_ones_own_trains_exports_reloads_and_decodes(tiny_run_inputs, tmp_path):
    """Trained as `launch/train.py` trains it: the script (`gated_kind.py` run as a script is train.py with
    this kind registered first) in a subprocess; here its one rank runs in-process."""
    target, data = tiny_run_inputs
    out = tmp_path / "run"
    train_in_process(tiny_train_args(target, data, out, "--drafter-kind", "gated", "--max-steps", 3, "--block-size",
                                     4, "--gamma", 2))
    # its term's figure in the step and eval records: every block scores at most B - 1 rows
    records = read_metrics(out) + read_metrics(out, "eval")
    assert len(records) >= 4 and all(0 < r["scored_per_block"] <= 3 for r in records), records
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["GatedDFlashDraftModel"]
    assert config["dflash_config"]["attention_gate_init"] == 1.0
    gate = load_file(out / "drafter" / "model.safetensors")["layers.0.attention_gate"]
    assert not torch.equal(gate, torch.ones_like(gate))  # trained

    drafter = DFlashDrafter.from_pretrained(out / "drafter").float()
    assert isinstance(drafter, gated_kind.GatedDrafter) and drafter.config.kind == "gated"
    assert torch.equal(drafter.layers[0].attention_gate.data, gate.float())
    hf = AutoModelForCausalLM.from_pretrained(target).float().eval()
    drafter.attach(TargetModel(hf, drafter.config.target_layer_ids).shared_weights())
    prompt = [5, 17, 42, 9, 33, 21]
    alone = greedy_decode(hf, prompt, max_new_tokens=24, stop_ids=[])
    decoded = speculative_decode(hf, drafter, prompt, max_new_tokens=24, stop_ids=[])
    assert decoded.tokens == alone.tokens and decoded.forwards <= len(alone.tokens)  # lossless
