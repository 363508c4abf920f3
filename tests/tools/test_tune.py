"""launch/tune_ds_config.py: the search space, and a real sweep with a failing trial in it."""
import json
import os

import pytest

from dflash.tools import tune
from dflash.training.ds_config import load_ds_config

from .. import preloaded
from ..conftest import ROOT


def test_search_space_is_the_product_of_the_options(tmp_path):
    base = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    trials = tune.search_space(base, [2, 3], [512, 1024], [1, 2], ["none", "cpu"], [False, True])
    assert len(trials) == 2 * 2 * 2 * 2 * 2 and len({t.name for t in trials}) == len(trials)
    t = next(t for t in trials if t.name == "zero3-offload-b1024-x2-ac")
    zero = t.ds_config["zero_optimization"]
    assert (t.token_budget, t.micro_batches, t.activation_checkpointing) == (1024, 2, True)
    assert zero["stage"] == 3 and zero["overlap_comm"] is False
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert "offload_param" not in next(t for t in trials if t.name == "zero2-offload-b512-x1").ds_config[
        "zero_optimization"], "ZeRO-2 offloads the optimizer only"
    for t in trials:  # every trial is a config the trainer accepts
        (tmp_path / "ds.json").write_text(json.dumps(t.ds_config))
        load_ds_config(tmp_path / "ds.json", world_size=2, grad_clip=1.0, bf16=False)


def test_best_is_the_fastest_finished_trial():
    a, b, c = (tune.Trial(n, {}, 512, 1) for n in "abc")
    a.status, a.tokens_per_s = "ok", 10.0
    b.status, b.tokens_per_s = "oom", 0.0
    c.status, c.tokens_per_s = "ok", 30.0
    assert tune.best([a, b, c]) is c
    assert "oom" in tune.summary_table([a, b, c])


@pytest.mark.slow
def test_sweep_survives_a_failing_trial_and_writes_the_fastest_config(tiny_run_inputs, tiny_store, tmp_path):
    target, _ = tiny_run_inputs
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    # budget 64 is less than most samples (51-172 tokens): that trial fails, the sweep goes on; the
    # tuner forked from the preloaded server, each trial a real `deepspeed` launch (ZeRO-3's trial
    # configs: test_search_space_is_the_product_of_the_options; the ranking: test_best_is_the_fastest_finished_trial)
    proc = preloaded.run(
        ROOT / "launch" / "tune_ds_config.py",
        ["--stages", "2", "--token-budgets", "512,64", "--micro-batches", "1", "--steps", "2", "--warmup", "1",
         "--no-defaults", "--workdir", tmp_path, "--", "--target", target, "--data", tiny_store, "--num-anchors", "8",
         "--draft-layers", "1", "--num-target-features", "2", "--num-workers", "0", "--dtype", "fp32",
         "--eval-fraction", "0"],
        env=env, cwd=tmp_path, timeout=900)  # not the checkout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trials = {t["name"]: t for t in json.loads((tmp_path / "summary.json").read_text())}
    assert sorted(trials) == ["zero2-b512-x1", "zero2-b64-x1"]
    for name, t in trials.items():
        if "b64" in name:
            assert t["status"] == "error" and "more than --token-budget 64" in t["detail"], t
        else:
            assert t["status"] == "ok" and t["tokens_per_s"] > 0 and t["step_seconds"] > 0, t
    winner = max((t for t in trials.values() if t["status"] == "ok"), key=lambda t: t["tokens_per_s"])
    assert json.loads((tmp_path / "best_ds_config.json").read_text()) == winner["ds_config"]
    assert winner["name"] == "zero2-b512-x1", "the one trial that runs"
    assert "best: zero2-b512-x1" in proc.stdout and "--token-budget 512 --step-tokens 512" in proc.stdout
    # the measured tokens/s is the trial's own metrics over the steps after the warm-up
    records = [json.loads(line) for line in (tmp_path / winner["name"] / "run" / "metrics.jsonl").open()]
    measured = [r for r in records if r["kind"] == "train"][1:]
    assert len(measured) == 2
    assert winner["tokens_per_s"] == pytest.approx(sum(r["real_tokens"] for r in measured)
                                                   / sum(r["step_seconds"] for r in measured))
