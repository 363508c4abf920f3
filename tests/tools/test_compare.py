"""launch/compare_modes.py: every order x layout, interleaved, on the tiny random target, each timed
on the same random samples of the split."""
import json
import os

import numpy as np
import pytest

from dflash.data.planner import PlannerConfig, plan_batches
from dflash.data.token_store import TokenStore
from dflash.tools.compare import MODES, summarize_throughput
from dflash.training.data import held_out_split, token_subset
from dflash.training.steps import step_ranges

from .. import preloaded
from ..conftest import ROOT
from ..runs import run_deepspeed

BUDGET, STEP_TOKENS, WARMUP, STEPS = 512, 512, 1, 2


def compare_args(target, store, out):
    return [str(a) for a in (
        "--target", target, "--data", store, "--output-dir", out, "--token-budget", BUDGET, "--step-tokens",
        STEP_TOKENS, "--num-anchors", 8, "--draft-layers", 1, "--num-target-features", 2, "--sample-log",
        "--eval-fraction", 0.1, "--no-progress", "--num-workers", 0, "--dtype", "fp32", "--steps", STEPS,
        "--warmup", WARMUP, "--json")]


def measured_samples(store, world_size):
    """Store indices of the subset every mode is timed on: about STEPS packed steps of tokens."""
    lengths = TokenStore(store).lengths
    train_idx, _ = held_out_split(len(lengths), 0.1, 0)
    return token_subset(train_idx, lengths, STEPS * STEP_TOKENS * world_size, 0), lengths


def expected_pass(store, order, layout, world_size):
    """Real and computed tokens and the steps of the measured pass (epoch 1 of the subset), from the
    plan alone (count x longest when padded)."""
    subset, lengths = measured_samples(store, world_size)
    sub = lengths[subset]
    plan = plan_batches(sub, PlannerConfig(BUDGET, order, layout, seed=0, world_size=world_size), epoch=1)
    batches = [b for rank in plan for b in rank]
    computed = sum(len(b) * int(sub[b].max()) if layout == "padded" else int(sub[b].sum()) for b in batches)
    return int(sub.sum()), computed, len(step_ranges(plan, sub, STEP_TOKENS))


def check_result(result, store, world_size, out):
    assert sorted(result) == sorted(MODES)
    base = result["sorted-padded"]["tokens_per_s"]
    subset, _ = measured_samples(store, world_size)
    for mode, s in result.items():
        order, layout = mode.split("-")
        for key in ("tokens_per_s", "computed_tokens_per_s", "efficiency", "ratio_to_sorted_padded",
                    "step_seconds_cv", "rank_seconds_spread", "epoch_efficiency"):
            assert np.isfinite(s[key]), (mode, key)
        assert s["ratio_to_sorted_padded"] == pytest.approx(s["tokens_per_s"] / base, rel=1e-12)
        real, computed, steps = expected_pass(store, order, layout, world_size)
        warmup, measured = s["steps_log"][:WARMUP], s["steps_log"][WARMUP:]
        assert [r["epoch"] for r in warmup] == [0] * WARMUP and {r["epoch"] for r in measured} == {1}
        assert (s["real_tokens"], s["computed_tokens"], s["steps"]) == (real, computed, steps), mode
        assert s["complete"] and s["lengths_seen"]["samples"] == subset.size
        assert s["efficiency"] == pytest.approx(real / computed, rel=1e-12)
        assert (s["efficiency"] == 1.0) == (layout == "packed")
        assert s["tokens_per_s"] == pytest.approx(real / sum(r["seconds"] for r in measured), rel=1e-12)
        assert all(len(r["rank_seconds"]) == world_size and min(r["rank_seconds"]) > 0 for r in s["steps_log"])
        # the samples each rank trained on in the measured pass: the subset, every one once
        used = []
        for rank in range(world_size):
            log = (out / "seed0" / mode / f"samples.rank{rank}.jsonl").read_text().splitlines()
            used += [i for line in log if json.loads(line)["epoch"] == 1
                     for mb in json.loads(line)["samples"] for i in mb]
        assert sorted(used) == subset.tolist(), mode
    assert result["sorted-padded"]["ratio_to_sorted_padded"] == 1.0
    # interleaved: round i of every mode (in MODES order) starts before round i + 1 of any mode
    rounds = min(len(s["steps_log"]) for s in result.values())
    starts = [[result[m]["steps_log"][i]["start"] for m in MODES] for i in range(rounds)]
    flat = [t for row in starts for t in row]
    assert flat == sorted(flat)


@pytest.mark.slow
def test_compare_modes_on_one_rank_prints_only_json_on_stdout(tiny_run_inputs, tiny_store, tmp_path):
    target, _ = tiny_run_inputs
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = preloaded.run(ROOT / "launch" / "compare_modes.py", compare_args(target, tiny_store, tmp_path / "out"),
                         env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    check_result(result, tiny_store, world_size=1, out=tmp_path / "out")
    assert "shuffle-padded:" in proc.stderr and "the seed measured 0.37x" in proc.stderr
    assert (tmp_path / "out" / "throughput.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "throughput.json").read_text()) == result


@pytest.mark.slow
def test_compare_modes_on_two_ranks_gathers_every_rank_and_calibrates_the_cost_model(tiny_run_inputs, tiny_store,
                                                                                      tmp_path):
    from dflash.data.cost import FEATURES, CostModel

    target, _ = tiny_run_inputs
    out = tmp_path / "out"
    proc = run_deepspeed([*compare_args(target, tiny_store, out), "--modes", ",".join([*MODES, "shuffle-packed+cost"])],
                         script=ROOT / "launch" / "compare_modes.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    cost = result.pop("shuffle-packed+cost")
    check_result(result, tiny_store, world_size=2, out=out)
    for mode, s in [*result.items(), ("shuffle-packed+cost", cost)]:
        assert len(s["rank_wait_seconds"]) == 2 and 0 <= s["wait_fraction"] < 1 and min(s["rank_busy_seconds"]) > 0
        for r in s["steps_log"]:
            # every rank's micro-batches: the cost features and the measured seconds
            assert len(r["micro_batch_costs"]) == 2 * r["micro_batches"]
            assert all(len(row) == len(FEATURES) + 1 and row[-1] > 0 for row in r["micro_batch_costs"])
        assert json.loads((out / "seed0" / mode / "config.json").read_text())["balance"] == mode.endswith("+cost")
    calibration = json.loads((out / "calibration.json").read_text())
    assert calibration["measurements"] == sum(2 * r["micro_batches"] for s in [*result.values(), cost]
                                              for r in s["steps_log"] if r["epoch"] == 1)
    assert np.isfinite(calibration["least_squares"]["r2"])
    model = CostModel.load(out / "cost_model.json")
    assert model.unit == "s" and model.coefficients().sum() > 0
    assert "waiting" in proc.stderr and "cost model, least_squares: R^2" in proc.stderr


def test_throughput_statistics_weigh_steps_by_time_and_sum_the_phases():
    def rec(seconds, real, computed, rank_seconds, waited=(0.0, 0.0), target=0.0):
        return {"seconds": seconds, "real_tokens": real, "computed_tokens": computed, "micro_batches": 1,
                "rank_seconds": rank_seconds, "rank_computed_tokens": [computed // 2, computed - computed // 2],
                "rank_busy_seconds": [t - w for t, w in zip(rank_seconds, waited, strict=True)],
                "rank_wait_seconds": list(waited),
                "phase_seconds": {"target_forward": target, "loss": seconds - target}}

    measured = [rec(1.0, 100, 200, [1.0, 1.0], (0.0, 0.5), target=0.25), rec(3.0, 300, 300, [3.0, 3.0], target=1.75)]
    s = summarize_throughput(measured, warmup=1)
    # waiting: 0.5 seconds of 2 ranks x (1 + 3) seconds
    assert s["wait_fraction"] == pytest.approx(0.5 / 8)
    assert s["rank_wait_seconds"] == [0.0, 0.5] and s["rank_busy_seconds"] == [4.0, 3.5]
    assert s["tokens_per_s"] == 400 / 4 and s["computed_tokens_per_s"] == 500 / 4
    assert s["efficiency"] == 400 / 500 and s["steps"] == 2 and s["warmup_steps"] == 1
    assert s["rank_seconds_spread"] == pytest.approx((0.5 / 0.75 + 0) / 2)
    assert s["step_seconds_cv"] == pytest.approx(np.std([1.0, 3.0]) / 2.0)
    # phases: seconds summed over the steps, shares of their total
    assert s["phases"]["seconds"] == {"target_forward": 2.0, "loss": 2.0}
    assert s["phases"]["shares"] == {"target_forward": 0.5, "loss": 0.5}
    assert "phases" not in summarize_throughput([{k: v for k, v in r.items() if k != "phase_seconds"}
                                                 for r in measured], warmup=0)
