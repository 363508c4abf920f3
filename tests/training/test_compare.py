"""launch/compare_modes.py: every order x layout, interleaved, on the tiny random target."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dflash.data.planner import PlannerConfig, plan_batches
from dflash.data.token_store import TokenStore
from dflash.training.compare import MODES, summarize_throughput
from dflash.training.data import held_out_split
from dflash.training.steps import step_ranges

from ..conftest import ROOT
from .conftest import run_deepspeed

BUDGET, STEP_TOKENS, WARMUP, STEPS = 512, 512, 1, 2  # 3 steps fit in epoch 0 on 2 ranks


def compare_args(target, store, out):
    return [str(a) for a in (
        "--target", target, "--data", store, "--output-dir", out, "--token-budget", BUDGET, "--step-tokens",
        STEP_TOKENS, "--num-anchors", 8, "--draft-layers", 1, "--num-target-features", 2, "--epochs", 2,
        "--eval-fraction", 0.1, "--no-progress", "--num-workers", 0, "--dtype", "fp32", "--steps", STEPS,
        "--warmup", WARMUP, "--json")]


def expected_tokens(store, order, layout, world_size):
    """Real and computed tokens of the measured steps, from the plan alone (count x longest when padded)."""
    lengths = TokenStore(store).lengths
    train_idx, _ = held_out_split(len(lengths), 0.1, 0)
    lengths = lengths[train_idx]
    plan = plan_batches(lengths, PlannerConfig(BUDGET, order, layout, seed=0, world_size=world_size), epoch=0)
    ranges = step_ranges(plan, lengths, STEP_TOKENS)[WARMUP:WARMUP + STEPS]
    batches = [b for first, end in ranges for rank in plan for b in rank[first:end]]
    real = sum(int(lengths[b].sum()) for b in batches)
    computed = sum(len(b) * int(lengths[b].max()) if layout == "padded" else int(lengths[b].sum()) for b in batches)
    return real, computed


def check_result(result, store, world_size):
    assert sorted(result) == sorted(MODES)
    base = result["sorted-padded"]["tokens_per_s"]
    for mode, s in result.items():
        order, layout = mode.split("-")
        for key in ("tokens_per_s", "computed_tokens_per_s", "efficiency", "ratio_to_sorted_padded",
                    "step_seconds_cv", "rank_seconds_spread"):
            assert np.isfinite(s[key]), (mode, key)
        assert s["ratio_to_sorted_padded"] == pytest.approx(s["tokens_per_s"] / base, rel=1e-12)
        real, computed = expected_tokens(store, order, layout, world_size)
        assert all(r["epoch"] == 0 for r in s["steps_log"]), "the measured steps fall in epoch 0"
        assert (s["real_tokens"], s["computed_tokens"]) == (real, computed), mode
        assert s["efficiency"] == pytest.approx(real / computed, rel=1e-12)
        if layout == "packed":
            assert s["efficiency"] == 1.0
        else:
            assert s["efficiency"] < 1.0
        measured = s["steps_log"][WARMUP:]
        assert s["tokens_per_s"] == pytest.approx(real / sum(r["seconds"] for r in measured), rel=1e-12)
        assert all(len(r["rank_seconds"]) == world_size and min(r["rank_seconds"]) > 0 for r in s["steps_log"])
    assert result["sorted-padded"]["ratio_to_sorted_padded"] == 1.0
    # interleaved: step i of every mode (in MODES order) starts before step i + 1 of any mode
    starts = [[result[m]["steps_log"][i]["start"] for m in MODES] for i in range(WARMUP + STEPS)]
    flat = [t for row in starts for t in row]
    assert flat == sorted(flat)


@pytest.mark.slow
def test_compare_modes_on_one_rank_prints_only_json_on_stdout(tiny_run_inputs, tiny_store, tmp_path):
    target, _ = tiny_run_inputs
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "compare_modes.py"),
                           *compare_args(target, tiny_store, tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    check_result(result, tiny_store, world_size=1)
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
    check_result(result, tiny_store, world_size=2)
    for mode, s in [*result.items(), ("shuffle-packed+cost", cost)]:
        assert len(s["rank_wait_seconds"]) == 2 and 0 <= s["wait_fraction"] < 1 and min(s["rank_busy_seconds"]) > 0
        for r in s["steps_log"]:
            # every rank's micro-batches: the cost features and the measured seconds
            assert len(r["micro_batch_costs"]) == 2 * r["micro_batches"]
            assert all(len(row) == len(FEATURES) + 1 and row[-1] > 0 for row in r["micro_batch_costs"])
        assert json.loads((out / "seed0" / mode / "config.json").read_text())["balance"] == mode.endswith("+cost")
    calibration = json.loads((out / "calibration.json").read_text())
    assert calibration["measurements"] == sum(2 * r["micro_batches"] for s in [*result.values(), cost]
                                              for r in s["steps_log"][WARMUP:])
    assert np.isfinite(calibration["least_squares"]["r2"])
    model = CostModel.load(out / "cost_model.json")
    assert model.unit == "s" and model.coefficients().sum() > 0
    assert "waiting" in proc.stderr and "cost model, least_squares: R^2" in proc.stderr


def test_throughput_statistics_leave_out_the_warmup_and_weigh_steps_by_time():
    def rec(seconds, real, computed, rank_seconds, waited=(0.0, 0.0)):
        return {"seconds": seconds, "real_tokens": real, "computed_tokens": computed, "micro_batches": 1,
                "rank_seconds": rank_seconds, "rank_computed_tokens": [computed // 2, computed - computed // 2],
                "rank_busy_seconds": [t - w for t, w in zip(rank_seconds, waited, strict=True)],
                "rank_wait_seconds": list(waited)}

    records = [rec(100.0, 10, 10, [100.0, 100.0], (50.0, 0.0)), rec(1.0, 100, 200, [1.0, 1.0], (0.0, 0.5)),
               rec(3.0, 300, 300, [3.0, 3.0])]
    s = summarize_throughput(records, warmup=1)
    # waiting: 0.5 seconds of 2 ranks x (1 + 3) seconds; the warm-up step's 50 s left out
    assert s["wait_fraction"] == pytest.approx(0.5 / 8)
    assert s["rank_wait_seconds"] == [0.0, 0.5] and s["rank_busy_seconds"] == [4.0, 3.5]
    assert s["tokens_per_s"] == 400 / 4 and s["computed_tokens_per_s"] == 500 / 4
    assert s["efficiency"] == 400 / 500 and s["steps"] == 2
    assert s["rank_seconds_spread"] == pytest.approx((0.5 / 0.75 + 0) / 2)
    assert s["step_seconds_cv"] == pytest.approx(np.std([1.0, 3.0]) / 2.0)
