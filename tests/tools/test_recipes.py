"""The recipe options: --loss and its terms' options, --feature-noise (seeded per sample), --optimizer
muon (DeepSpeed's Muon against a reference), and a run with all of them that stops and resumes bitwise
like the uninterrupted one under every ZeRO stage; the recipe comparison's recipes."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from dflash.data.batch import PackedBatch
from dflash.errors import UserError
from dflash.training.config import load_config
from dflash.training.noise import FeatureNoise

from .. import preloaded
from ..conftest import ROOT
from ..runs import run_deepspeed, tiny_train_args, without_timings


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
    (["--optimizer", "muon", "--grad-clip", "1"], "--grad-clip: must be 0 with --optimizer muon (DeepSpeed clips "
     "Muon's orthogonalised update by the raw gradient's norm, shrinking it), got 1.0"),
    (["--muon-lr", "0.01"], "--muon-lr: applies to --optimizer muon"),
    (["--optimizer", "muon", "--muon-momentum", "1"], "--muon-momentum: must be in [0, 1), got 1.0"),
    (["--optimizer", "sgd"], "--optimizer: must be one of adamw, muon, got 'sgd'"),
])
def test_recipe_options_name_the_flag(argv, message):
    with pytest.raises(UserError) as e:
        load_config(["--data", "d.jsonl", *argv])
    assert str(e.value) == message


def test_the_recipe_builds_the_objective():
    from types import SimpleNamespace

    from dflash.training.models import training_loss

    drafter = SimpleNamespace(lm_head=torch.zeros(10, 4), config=SimpleNamespace(kind="dflash", kind_settings=None))
    cfg = load_config(["--data", "d.jsonl", "--loss", "ce=0.5,dpace=1,kl=0.2", "--dpace-alpha", "0.3",
                       "--distill-temperature", "2"])
    loss = training_loss(cfg.loss, cfg.drafter.block_size, drafter)
    assert loss.ce_weight == 0.5 and [(t.name, t.weight) for t in loss.terms] == [("dpace", 1.0), ("kl", 0.2)]
    assert loss.terms[0].alpha == 0.3 and loss.terms[1].temperature == 2.0
    assert loss.chunk_rows % 15 == 0  # D-PACE weighs whole blocks of 15 scored slots
    plain = training_loss(load_config(["--data", "d.jsonl"]).loss, 16, drafter)
    assert plain.ce_weight == 1.0 and plain.terms == () and plain.chunk_rows == 1024
    # what every recipe is compared by
    held_out = training_loss(cfg.loss, cfg.drafter.block_size, drafter, recipe=False)
    assert held_out.ce_weight == 1.0 and held_out.terms == ()


def test_muon_defaults_and_the_deepspeed_configs_it_refuses():
    from dflash.training.ds_config import load_ds_config, with_optimizer
    from dflash.training.plan import drafter_settings, resolve_run

    cfg = load_config(["--data", "d.jsonl", "--optimizer", "muon", "--lr", "2e-4"])
    assert cfg.optim.grad_clip == 0 and cfg.optim.muon_lr == pytest.approx(2e-3)  # speculators' 10x
    assert load_config(["--data", "d.jsonl"]).optim.grad_clip == 1.0

    def config(name, **zero):
        c = load_ds_config(f"ds_configs/{name}.json", world_size=1, grad_clip=0.0, bf16=False)
        c["zero_optimization"].update(zero)
        return with_optimizer(c, "muon", lr=1e-3, muon_lr=1e-2, momentum=0.9, weight_decay=0.0, named="ds.json")

    for stage in (1, 2, 3):
        made = config(f"zero{stage}")
        assert made["optimizer"]["type"] == "Muon" and made["optimizer"]["params"]["muon_lr"] == 1e-2
        assert made["zero_optimization"].get("reduce_scatter", True) is (stage != 3)
    with pytest.raises(UserError, match="--optimizer muon: ds.json offloads the optimizer"):
        config("zero3_offload")
    with pytest.raises(UserError, match="--optimizer muon: ds.json sets 'reduce_scatter' under ZeRO-3"):
        config("zero3", reduce_scatter=True)
    clipped = load_ds_config("ds_configs/zero1.json", world_size=1, grad_clip=1.0, bf16=False)
    with pytest.raises(UserError, match="--optimizer muon: ds.json sets 'gradient_clipping' 1.0"):
        with_optimizer(clipped, "muon", lr=1e-3, muon_lr=1e-2, momentum=0.9, weight_decay=0.0, named="ds.json")
    # AdamW: the trainer hands DeepSpeed its torch optimizer; the config has none
    assert "optimizer" not in with_optimizer(clipped, "adamw", lr=1e-3, muon_lr=0, momentum=0, weight_decay=0,
                                             named="ds.json")
    # a resume with the other optimizer is refused: its state is another optimizer's
    assert drafter_settings(resolve_run(cfg), 4)["--optimizer"] == "muon"
    default = load_config(["--data", "d.jsonl"])
    assert drafter_settings(resolve_run(default), 4)["--optimizer"] == "adamw"  # the default too


@pytest.mark.slow
def test_muon_steps_are_deepspeeds_muon_under_every_zero_stage_on_two_ranks(tmp_path):
    """Three steps of --optimizer muon under each ZeRO stage are a plain reference's (muon_script.py), and
    CPU ranks build no DeepSpeed op for them (its AdamW half is torch's: FusedAdam's C++ op took minutes of
    compiling at a CPU rank's first Muon step)."""
    extensions = tmp_path / "torch_extensions"
    proc = run_deepspeed(["1,2,3"], script=ROOT / "tests" / "training" / "muon_script.py",
                         env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not extensions.exists() or list(extensions.rglob("*")) == [], list(extensions.rglob("*"))
    for stage in (1, 2, 3):
        matrix, norm = map(float, proc.stdout.split(f"MUON_MAX_ERR[{stage}]=")[1].split()[:2])
        assert matrix < 2e-3 and norm < 1e-4, (stage, matrix, norm)
    low, high = map(float, proc.stdout.split("MUON_UPDATE_SV=")[1].split()[:2])
    assert 0.5 < low <= high < 1.5  # orthogonalised (Newton-Schulz's band), not the raw gradient's spread


RECIPE = ("--loss", "ce=1,dpace=0.5,kl=0.5,lk=0.2", "--feature-noise", 0.05, "--step-tokens", 600,
          "--checkpoint-every", 2, "--no-export", "--no-balance", "--sample-log")


def history(out):
    with open(out / "metrics.jsonl") as f:
        return [without_timings(json.loads(line)) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_terms_noise_and_muon_train_and_resume_bitwise_under_every_zero_stage(tiny_run_inputs, tmp_path, stage):
    target, data = tiny_run_inputs
    recipe = (*RECIPE, "--deepspeed_config", f"ds_configs/zero{stage}.json", "--optimizer", "muon")

    def ok(args):
        proc = run_deepspeed(tiny_train_args(target, data, *args))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    ok([tmp_path / "whole", *recipe])
    # the whole run's folder less its newest checkpoint: a run stopped after the one before, its later
    # records left behind (as a crash leaves them); the resume repeats those steps from the checkpoint
    shutil.copytree(tmp_path / "whole", tmp_path / "run")
    checkpoints = sorted(p for p in (tmp_path / "run" / "checkpoints").iterdir() if (p / "COMPLETE").is_file())
    shutil.rmtree(checkpoints[-1])
    resumed = ok([tmp_path / "run", *recipe, "--resume"])
    assert f"resumed from {checkpoints[-2]}" in resumed.stdout
    whole = history(tmp_path / "whole")
    assert history(tmp_path / "run") == whole
    train = [r for r in whole if r["kind"] == "train"]
    assert len(train) >= 6 and all(r["step_applied"] for r in train)


def test_recipes_share_everything_but_the_recipe_options():
    from dflash.tools.recipes import parse_recipes

    recipes = parse_recipes("ce: ; mix: --loss ce=1,dpace=0.5 --feature-noise 0.05", ["--data", "d.jsonl"])
    assert list(recipes) == ["ce", "mix"] and recipes["ce"].loss.loss == "ce=1"
    assert recipes["mix"].loss.loss == "ce=1,dpace=0.5" and recipes["mix"].loss.feature_noise == 0.05
    assert recipes["mix"].inputs.data == recipes["ce"].inputs.data == "d.jsonl"
    kinds = parse_recipes("dflash: ; dflash2: --drafter-kind dflash2 --selector-weight 0.5", ["--data", "d.jsonl"])
    assert [(c.drafter.drafter_kind, c.loss.selector_weight) for c in kinds.values()] == [("dflash", 1.0),
                                                                                          ("dflash2", 0.5)]
    for text, message in (("a: --num-anchors 8", "--recipes a: sets --num-anchors, which every recipe shares"),
                          ("a: --loss foo=1", "--recipes a: --loss: unknown part 'foo'"),
                          ("a: ; a: --lr 1e-3", "--recipes: a is given twice"),
                          ("--lr 1e-3", "--recipes: '--lr 1e-3' is not 'name: flags'"),
                          # an unclosed quote was shlex's "No closing quotation" traceback
                          ("a: --loss 'ce=1", "--recipes a: \"--loss 'ce=1\" cannot be split into flags (no closing "
                                              "quotation: a quote left open?)")):
        with pytest.raises(UserError, match="^" + re.escape(message)):
            parse_recipes(text, ["--data", "d.jsonl"])


def test_recipes_summary_at_equal_steps_and_seconds_table_and_plot(tmp_path):
    from dflash.tools.recipes import plot_recipes, recipes_table, summarise

    def seed(s, tau, seconds):
        return {"seed": s, "evals": [{"step": 0, "train_seconds": 0.0, "loss": 4.0, "tau": 1.0, "tau@1": 1.5},
                                     {"step": 5, "train_seconds": seconds, "loss": 3.0, "tau": tau, "tau@1": tau + 1}]}

    # dpace's steps are slower: 4 s and 2.5 s against ce's 2 s
    result = {"ce": {"seeds": [seed(0, 2.0, 2.0), seed(1, 2.2, 2.0)]},
              "dpace_with_noise": {"seeds": [seed(0, 2.5, 4.0), seed(1, 2.3, 2.5)]}}
    summarise(result)
    assert result["dpace_with_noise"]["final"]["tau"]["mean"] == pytest.approx(2.4)
    assert result["dpace_with_noise"]["final"]["train_seconds"]["mean"] == pytest.approx(3.25)
    # at ce's 2 s: dpace is half of its way from 1.0 to 2.5 in seed 0, 4/5 of it from 1.0 to 2.3 in seed 1
    assert result["dpace_with_noise"]["equal_time"]["tau"]["mean"] == pytest.approx((1.75 + 2.04) / 2)
    assert result["dpace_with_noise"]["equal_time"]["tau@1"]["mean"] == pytest.approx((2.5 + 2.94) / 2)
    assert result["ce"]["equal_time"]["tau"] == result["ce"]["final"]["tau"]
    table = recipes_table(result)
    assert "tau@1" in table and table.splitlines()[3].startswith("dpace_with_noise") and "2.400" in table
    assert "1.895" in table.splitlines()[3] and "mean 2.0 s" in table
    assert len({line.index("±") for line in table.splitlines()[2:4]}) == 1, "columns aligned past a long name"
    plot_recipes(result, tmp_path / "r.png", "title")
    assert (tmp_path / "r.png").stat().st_size > 1000


@pytest.mark.slow
def test_compare_recipes_runs_the_recipes_interleaved_for_every_seed(tiny_run_inputs, tmp_path):
    target, data = tiny_run_inputs
    out = tmp_path / "cmp"
    args = [str(a) for a in tiny_train_args(target, data, out, "--step-tokens", 600, "--eval-sample-turns", 4)]
    recipes = "ce: ; mix: --loss ce=1,dpace=0.5,kl=0.5 --feature-noise 0.05"
    proc = preloaded.run(ROOT / "launch" / "compare_recipes.py", [*args, "--recipes", recipes, "--steps", "3",
                                                                  "--seeds", "0,1", "--eval-interval", "2"],
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}, cwd=ROOT,
                         timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "recipes.json").read_text())["recipes"]
    assert list(result) == ["ce", "mix"] and result["mix"]["flags"].startswith("--loss")
    for stats in result.values():
        assert [s["seed"] for s in stats["seeds"]] == [0, 1]
        assert all([e["step"] for e in s["evals"]] == [0, 2, 3] for s in stats["seeds"])
        assert "tau@1" in stats["final"] and "tau@1" in stats["equal_time"]
    assert (out / "recipes.png").is_file() and "@equal s" in proc.stderr
