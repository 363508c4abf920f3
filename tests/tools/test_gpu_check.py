"""The scripts a lent GPU machine runs, run here on the CPU so that they cannot rot: the one-shot GPU
check (tiny shapes, Triton interpreter; the end-to-end stage on the demo target's shape with random
weights) and the kernel benchmark's promise to keep what it measured when it is cut short."""
import json
import os
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

from ..conftest import ROOT


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def test_gpu_check_help_says_what_it_does_and_makes_no_folder(tmp_path):
    """`--help` (README: every command has it) prints the script's text and hands over to gpu_check.py's
    own --help (PYTHON=echo shows the call); an option where OUT belongs is refused; no folder made."""
    script = str(ROOT / "launch" / "gpu_check.sh")
    env = {**os.environ, "PYTHON": "echo"}
    done = subprocess.run(["bash", script, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("One-shot GPU check for a lent GPU machine")
    assert "bash launch/gpu_check.sh OUT --dry-run" in done.stdout
    assert done.stdout.endswith(f"{ROOT / 'launch' / 'gpu_check.py'} --help\n")
    refused = subprocess.run(["bash", script, "--dry-run"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.startswith("error: OUT --dry-run: the output folder comes first")
    assert list(tmp_path.iterdir()) == []


def test_gpu_check_dry_run(tmp_path):
    """The whole script as the GPU machine runs it (gpu_check.sh: no install, PYTHONPATH=$PWD),
    with --dry-run: every stage writes its JSON and passes."""
    out = tmp_path / "out"
    # --wheels: none (a developer's wheels/ for the GPU image stay out of it; CI has none)
    done = subprocess.run(["bash", "launch/gpu_check.sh", str(out), "--dry-run", "--wheels", str(tmp_path / "none")],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "all passed" in (out / "log.txt").read_text()
    env = json.loads((out / "env.json").read_text())
    assert env["interpreter"] and env["torch"] and env["triton"]
    summary = json.loads((out / "summary.json").read_text())
    assert {name: s["passed"] for name, s in summary["stages"].items()} == {
        "correctness": True, "kernels": True, "fused_ops": True, "e2e": True, "memory": True, "kinds": True}
    ops = json.loads((out / "fused_ops.json").read_text())
    for op in ("block_conv", "head_topk"):
        assert [c["call"] for c in ops[op]["checks"] if c["passed"]] == ["first call", "second call"]
        assert all(v > 0 for v in ops[op]["timings"].values())  # ours and the torch path's times
    checks = json.loads((out / "correctness.json").read_text())["checks"]
    seen = {(c["op"], c["mode"], c["call"]) for c in checks if c["passed"]}
    assert seen == {(op, mode, call) for op in ("varlen", "block", "block-sliding")
                    for mode in ("atomic", "deterministic")
                    for call in ("first call", "second call")}
    assert all(c["bitwise_equal_to_first_call"] for c in checks if c["mode"] == "deterministic" and
               c["call"] == "second call")
    bench = json.loads((out / "bench_kernels.json").read_text())
    assert list(bench["results"]) == ["seed-like/shuffled"]  # the dry run's one order; the GPU's: sorted too
    for case in bench["results"]:
        for op in ("varlen", "block"):
            ours = bench["results"][case][op]["dflash-triton"]
            assert ours["fwd_ms"] > 0 and ours["fwdbwd_ms"] > 0
    e2e = json.loads((out / "e2e.json").read_text())
    check_e2e(e2e, out / "e2e_runs")
    check_memory(json.loads((out / "memory.json").read_text()))
    check_dflash2(json.loads((out / "dflash2.json").read_text()), e2e, out / "dflash2_runs")
    from dflash.drafter.kinds import BUILT_IN, DEFAULT, drafter_kind

    for kind in (drafter_kind(name) for name in BUILT_IN if name != DEFAULT):  # at their small sizes
        small = out / f"{kind.name}_runs" / "small_drafter"
        config = json.loads((small / "config.json").read_text())
        assert json.loads((out / f"{kind.name}.json").read_text())["options"][-4:-2] == ["--init-drafter", str(small)]
        assert kind.read_settings(config) == kind.small_settings(config["hidden_size"], config["vocab_size"])


# the default recipe, as the README gives it: the slot-weighted cross-entropy with AdamW
DEFAULT_RECIPE = {"loss": "ce=1", "optimizer": "adamw", "lr": 6e-4, "weight_decay": 0.0, "warmup_ratio": 0.04,
                  "schedule": "cosine", "grad_clip": 1.0, "gamma": 7.0, "feature_noise": 0.0}


def check_recipe(report, runs, kind):
    """The report says its steps trained the default recipe, and so do the config.json files the
    timed trainers wrote (with their drafter kind)."""
    assert report["recipe_is_default"] and DEFAULT_RECIPE.items() <= report["recipe"].items()
    configs = list(runs.glob("seed0/*/config.json"))
    assert configs
    for path in configs:
        options = json.loads(path.read_text())
        assert {k: options[k] for k in report["recipe"]} == report["recipe"], path
        assert options["drafter_kind"] == kind, path


def check_e2e(e2e, runs):
    """Every mode timed on the same samples, one whole pass, with the phases of its steps, the
    default recipe."""
    assert e2e["passed"] and e2e["kernel_configs"].startswith("pinned")
    check_recipe(e2e, runs, "dflash")
    results = e2e["results"]
    assert list(results) == ["sorted-padded", "shuffle-packed", "bucketed-packed"]
    seen = results["sorted-padded"]["lengths_seen"]
    assert seen["samples"] > 1 and seen["tokens"] >= 2 * 4 * 512  # 2 packed steps of 4 x 512 tokens
    for mode, s in results.items():
        assert s["complete"] and s["lengths_seen"] == seen, mode  # the same samples, all of them
        assert s["real_tokens"] == seen["tokens"] and s["warmup_steps"] == 1
        assert all(r["epoch"] == 1 for r in s["steps_log"][1:]) and s["steps_log"][0]["epoch"] == 0
        assert s["tokens_per_s"] == pytest.approx(s["real_tokens"] / sum(r["seconds"] for r in s["steps_log"][1:]))
        shares = s["phases"]["shares"]
        assert sum(shares.values()) == pytest.approx(1.0)
        assert all(shares[p] > 0 for p in ("target_forward", "drafter_forward", "loss", "drafter_backward",
                                           "optimizer")), shares
        assert (s["efficiency"] < 1) == mode.endswith("padded") and s["epoch_efficiency"] <= 1
    assert results["sorted-padded"]["ratio_to_sorted_padded"] == 1.0
    assert all("selector_accuracy" not in r for s in results.values() for r in s["steps_log"])  # DFlash's


def check_memory(memory):
    """Both row budgets ran, each micro-batch within its budget, the tight one with clearly fewer
    rows; the plan's estimate against the measured peak (tensor bytes counted after every op on the
    CPU): they agree as a whole (ZeRO-2's buckets are most of it here) and in what the budgets'
    micro-batches add (the rows' part alone: the plan prices the CPU's reference attention high)."""
    assert memory["passed"] and memory["measured_by"].startswith("tensor bytes")
    tight, planned = memory["budgets"]["one-sample"], memory["budgets"]["planned"]
    assert tight["row_budget"] == 16 * 8 and planned["row_budget"] == 0  # block x anchors; no cap on the CPU
    for b in (tight, planned):
        assert b["steps"] == memory["steps_per_budget"] == 2 and b["micro_batches"] >= b["steps"]
        assert b["dearest_micro_batch"]["rows"] <= b["most_rows"]
        assert b["estimate_bytes"] == b["estimate_items"]["total"] > 0 and b["measured_bytes"] > 0
        assert b["ratio"] == pytest.approx(b["measured_bytes"] / b["estimate_bytes"])
        assert 0.9 <= b["ratio"] <= 1.1, b  # 0.99-1.0, 2026-12-03
    assert tight["most_rows"] <= 128 and planned["most_rows"] >= 3 * 128  # several samples' blocks
    assert tight["estimate_at_budgets_bytes"] >= tight["estimate_bytes"]
    extra = memory["between_budgets"]
    assert extra["estimate_bytes"] == planned["estimate_bytes"] - tight["estimate_bytes"] > 0
    assert extra["measured_bytes"] == planned["measured_bytes"] - tight["measured_bytes"] > 0
    assert 0.7 <= extra["ratio"] <= 1.15, extra  # 0.87, 2026-12-03


def check_dflash2(dflash2, e2e, runs):
    """DFlash2 steps ran with their own drafter (its selector's figures in every step's record), the
    default recipe, on the samples of e2e's shuffle-packed pass, timed."""
    assert dflash2["passed"] and dflash2["drafter_kind"] == "dflash2"
    check_recipe(dflash2, runs, "dflash2")
    assert set(dflash2["drafter_layer_types"]) == {"sliding_attention"}  # the release's layers
    s, dflash = dflash2["results"]["shuffle-packed"], e2e["results"]["shuffle-packed"]
    assert s["complete"] and s["lengths_seen"] == dflash["lengths_seen"] and s["warmup_steps"] == 1
    assert all({"selector_recall", "selector_accuracy", "argmax_anchor_tau"} <= r.keys() for r in s["steps_log"])
    seconds = [r["seconds"] for r in s["steps_log"][1:]]
    assert s["tokens_per_s"] == pytest.approx(s["real_tokens"] / sum(seconds))
    assert s["step_seconds_median"] == pytest.approx(float(np.median(seconds)))
    assert s["ratio_to_dflash"] == pytest.approx(s["tokens_per_s"] / dflash["tokens_per_s"])


def test_stages_leave_the_training_stages_after_them_their_time(tmp_path):
    from dflash.tools import gpu_check
    stages = ["correctness", "kernels", "e2e", "memory", "kinds"]
    kept = {"e2e": 200.0, "memory": 40.0, "kinds": 50.0}
    assert [gpu_check.stage_deadline(s, stages, 450.0, kept) for s in stages] == [160.0, 160.0, 360.0, 400.0, 450.0]
    assert gpu_check.stage_deadline("kernels", ["kernels"], 450.0, kept) == 450.0
    assert gpu_check.stage_deadline("kernels", ["e2e", "kernels"], 450.0, kept) == 450.0
    assert gpu_check.stage_deadline("e2e", ["e2e", "kinds"], 450.0, kept) == 400.0


def test_training_stages_out_of_time_record_what_they_skipped(tmp_path):
    """No time left: nothing is built (no run folder), every mode and budget is recorded as
    skipped, and the stages fail."""
    done = subprocess.run([sys.executable, "launch/gpu_check.py", str(tmp_path), "--dry-run", "--stages",
                           "e2e,memory,kinds", "--budget", "0", "--wheels", str(tmp_path / "none")], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    skipped = {"skipped": "out of time"}
    e2e = json.loads((tmp_path / "e2e.json").read_text())
    assert e2e["passed"] is False
    assert e2e["results"] == {m: skipped for m in ("sorted-padded", "shuffle-packed", "bucketed-packed")}
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert memory["passed"] is False and memory["budgets"] == {"one-sample": skipped, "planned": skipped}
    dflash2 = json.loads((tmp_path / "dflash2.json").read_text())
    assert dflash2["passed"] is False and dflash2["results"] == {"shuffle-packed": skipped}
    assert not any(tmp_path.glob("*_runs"))


def test_gpu_check_refuses_unknown_stages(tmp_path):
    done = subprocess.run([sys.executable, "launch/gpu_check.py", str(tmp_path), "--dry-run", "--stages", "nope"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown stage(s) ['nope']" in done.stderr


def test_carried_wheels_go_on_the_path(tmp_path, monkeypatch):
    """What the machine lacks (DeepSpeed for the end-to-end stage) comes as wheels in wheels/, first
    on the path (the carried set was resolved together)."""
    from dflash.tools import gpu_check
    for name, answer in (("carried_pkg-1.0-py3-none-any.whl", 42), ("carried_pkg-2.0-cp27-cp27mu-win32.whl", 0)):
        with zipfile.ZipFile(tmp_path / name, "w") as z:
            z.writestr("carried_pkg/__init__.py", f"ANSWER = {answer}\n")
            z.writestr(f"carried_pkg-{name.split('-')[1]}.dist-info/METADATA", "Name: carried-pkg\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert gpu_check.use_carried_wheels(tmp_path) == (["carried_pkg-1.0-py3-none-any.whl"],
                                                      ["carried_pkg-2.0-cp27-cp27mu-win32.whl"])
    assert sys.path[0] == str(tmp_path / f"site-{sys.implementation.cache_tag}")
    import carried_pkg

    assert carried_pkg.ANSWER == 42
    sys.modules.pop("carried_pkg")
    assert gpu_check.use_carried_wheels(tmp_path / "none") == ([], [])


def test_benchmark_killed_midway_keeps_what_it_measured(tmp_path):
    """bench_kernels.py rewrites its JSON after every measurement: killed (as a timeout does) after
    the first one, the file holds it, whole."""
    path = tmp_path / "bench_kernels.json"
    proc = subprocess.Popen([sys.executable, "launch/bench_kernels.py", "--out", str(tmp_path), "--tokens", "64"],
                            cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        first = None
        while first is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            if path.exists():
                case = json.loads(path.read_text())["results"]["seed-like/sorted"]
                first = case.get("varlen", {}).get("dflash-triton", {}).get("fwd_ms")
        assert first is not None, "no measurement written"
        assert "block" not in case, "written only after the whole case"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed before finishing
    report = json.loads(path.read_text())
    assert report["results"]["seed-like/sorted"]["varlen"]["dflash-triton"]["fwd_ms"] == pytest.approx(first)
