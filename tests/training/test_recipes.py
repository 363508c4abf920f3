"""The recipe options: --loss and its terms' options, --optimizer muon (DeepSpeed's Muon, its config and
refusals), --feature-noise (seeded per sample), and a run with all of them that stops and resumes
bitwise like the uninterrupted one under every ZeRO stage."""
from __future__ import annotations

import json

import pytest
import torch

from dflash.data.batch import PackedBatch
from dflash.errors import UserError
from dflash.training.config import load_config
from dflash.training.noise import FeatureNoise

from .conftest import run_deepspeed, tiny_train_args, without_timings


def packed(lengths, sample_ids):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1])
    return PackedBatch(input_ids=torch.zeros(n, dtype=torch.long), loss_mask=torch.ones(n, dtype=torch.bool),
                       position_ids=torch.zeros(n, dtype=torch.long), cu_seqlens=cu, cu_seqlens_cpu=cu,
                       max_seqlen=max(lengths), sample_ids=torch.tensor(sample_ids))


def test_feature_noise_is_a_function_of_seed_epoch_and_sample_not_of_the_batch():
    noise = FeatureNoise(0.5, seed=3)
    features = torch.randn(30, 8)
    together = noise(features, packed([10, 20], [7, 9]), epoch=1)
    alone = noise(features[10:], packed([20], [9]), epoch=1)  # sample 9 in another micro-batch
    assert torch.equal(together[10:], alone)
    assert not torch.equal(noise(features, packed([10, 20], [7, 9]), epoch=2), together)  # redrawn every epoch
    assert not torch.equal(FeatureNoise(0.5, seed=4)(features, packed([10, 20], [7, 9]), 1), together)
    drawn = together - features
    assert abs(float(drawn.std()) - 0.5) < 0.1 and abs(float(drawn.mean())) < 0.1
    assert not torch.equal(drawn[:10], drawn[10:20])  # samples differ
    assert FeatureNoise(0.0, seed=3)(features, packed([10, 20], [7, 9]), 1) is features
    with pytest.raises(ValueError, match=">= 0"):
        FeatureNoise(-1.0, seed=0)


@pytest.mark.parametrize("argv, message", [
    (["--loss", "ce=1,focal=1"], "--loss: unknown part 'focal' (known: ce, dpace, kl, lk)"),
    (["--loss", "ce=0"], "--loss: 'ce=0' weighs nothing: give at least one part a weight > 0, e.g. ce=1"),
    (["--dpace-alpha", "1.5"], "--dpace-alpha: must be in [0, 1], got 1.5"),
    (["--distill-temperature", "0"], "--distill-temperature: must be > 0, got 0.0"),
    (["--optimizer", "sgd"], "--optimizer: must be one of adamw, muon, got 'sgd'"),
])
def test_recipe_options_name_the_flag(argv, message):
    with pytest.raises(UserError) as e:
        load_config(["--data", "d.jsonl", *argv])
    assert str(e.value) == message


def test_muon_config_lr_and_refusals():
    from dflash.training.models import muon_ds_config

    cfg = load_config(["--data", "d.jsonl", "--optimizer", "muon", "--lr", "2e-4", "--weight-decay", "0.1"])
    stage3 = {"zero_optimization": {"stage": 3, "overlap_comm": False}}
    out = muon_ds_config(cfg, stage3)
    params = out["optimizer"]["params"]
    assert out["optimizer"]["type"] == "Muon" and params["muon_lr"] == pytest.approx(2e-3)
    assert params["adam_lr"] == 2e-4 and params["weight_decay"] == 0.1
    assert out["zero_optimization"]["reduce_scatter"] is False and "optimizer" not in stage3  # not mutated
    given = load_config(["--data", "d.jsonl", "--optimizer", "muon", "--muon-lr", "0.01"])
    assert muon_ds_config(given, {"zero_optimization": {"stage": 1}})["optimizer"]["params"]["muon_lr"] == 0.01
    with pytest.raises(UserError, match="--optimizer muon: the optimizer is offloaded"):
        muon_ds_config(cfg, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(UserError, match="'reduce_scatter': true"):
        muon_ds_config(cfg, {"zero_optimization": {"stage": 3, "reduce_scatter": True}})


def test_the_recipe_builds_the_objective():
    from dflash.training.models import recipe_loss

    lm_head = torch.zeros(10, 4)
    loss = recipe_loss(load_config(["--data", "d.jsonl", "--loss", "ce=0.5,dpace=1,kl=0.2", "--dpace-alpha", "0.3",
                                    "--distill-temperature", "2"]), lm_head)
    assert loss.ce_weight == 0.5 and [(t.name, t.weight) for t in loss.terms] == [("dpace", 1.0), ("kl", 0.2)]
    assert loss.terms[0].alpha == 0.3 and loss.terms[1].temperature == 2.0
    assert loss.chunk_rows % 15 == 0  # D-PACE weighs whole blocks of 15 scored slots
    plain = recipe_loss(load_config(["--data", "d.jsonl"]), lm_head)
    assert plain.ce_weight == 1.0 and plain.terms == () and plain.chunk_rows == 1024


RECIPE = ("--optimizer", "muon", "--loss", "ce=1,dpace=0.5,kl=0.5,lk=0.2", "--feature-noise", 0.05,
          "--step-tokens", 600, "--checkpoint-every", 2, "--no-export", "--no-balance", "--sample-log")
NO_COMPILE = {"TORCH_COMPILE_DISABLE": "1"}  # DeepSpeed's Muon compiles its Newton-Schulz steps: minutes on CPU


def history(out):
    with open(out / "metrics.jsonl") as f:
        return [without_timings(json.loads(line)) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_muon_terms_and_noise_train_and_resume_bitwise_under_every_zero_stage(tiny_run_inputs, tmp_path, stage):
    target, data = tiny_run_inputs
    recipe = (*RECIPE, "--deepspeed_config", f"ds_configs/zero{stage}.json")

    def ok(args):
        proc = run_deepspeed(tiny_train_args(target, data, *args), env=NO_COMPILE)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    ok([tmp_path / "whole", *recipe])
    ok([tmp_path / "run", *recipe, "--stop-at-step", 3])
    resumed = ok([tmp_path / "run", *recipe, "--resume"])
    assert "resumed from" in resumed.stdout
    whole = history(tmp_path / "whole")
    assert history(tmp_path / "run") == whole
    train = [r for r in whole if r["kind"] == "train"]
    assert len(train) >= 6 and all(r["step_applied"] for r in train)
