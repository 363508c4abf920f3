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

import pytest

from .conftest import ROOT, launch_script


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


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
    assert {name: s["passed"] for name, s in summary["stages"].items()} == {"correctness": True, "kernels": True,
                                                                             "e2e": True}
    checks = json.loads((out / "correctness.json").read_text())["checks"]
    seen = {(c["op"], c["mode"], c["call"]) for c in checks if c["passed"]}
    assert seen == {(op, mode, call) for op in ("varlen", "block", "block-sliding")
                    for mode in ("atomic", "deterministic")
                    for call in ("first call", "second call")}
    assert all(c["bitwise_equal_to_first_call"] for c in checks if c["mode"] == "deterministic" and
               c["call"] == "second call")
    bench = json.loads((out / "bench_kernels.json").read_text())
    for case in ("seed-like/sorted", "seed-like/shuffled"):
        for op in ("varlen", "block"):
            ours = bench["results"][case][op]["dflash-triton"]
            assert ours["fwd_ms"] > 0 and ours["fwdbwd_ms"] > 0
    check_e2e(json.loads((out / "e2e.json").read_text()))


def check_e2e(e2e):
    """Every mode timed on the same samples, one whole pass, with the phases of its steps."""
    assert e2e["passed"] and e2e["kernel_configs"].startswith("pinned")
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


def test_stages_before_the_end_to_end_one_leave_it_its_time(tmp_path):
    gpu_check = launch_script("gpu_check")
    stages = ["correctness", "kernels", "e2e"]
    assert [gpu_check.stage_deadline(s, stages, 450.0, 200.0) for s in stages] == [250.0, 250.0, 450.0]
    assert gpu_check.stage_deadline("kernels", ["kernels"], 450.0, 200.0) == 450.0
    assert gpu_check.stage_deadline("kernels", ["e2e", "kernels"], 450.0, 200.0) == 450.0


def test_an_end_to_end_stage_out_of_time_records_the_modes_it_skipped(tmp_path):
    """No time left: nothing is built, every mode is recorded as skipped, and the stage fails."""
    done = subprocess.run([sys.executable, "launch/gpu_check.py", str(tmp_path), "--dry-run", "--stages", "e2e",
                           "--budget", "0", "--wheels", str(tmp_path / "none")], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    e2e = json.loads((tmp_path / "e2e.json").read_text())
    assert e2e["passed"] is False
    assert e2e["results"] == {m: {"skipped": "out of time"} for m in ("sorted-padded", "shuffle-packed",
                                                                       "bucketed-packed")}


def test_gpu_check_refuses_unknown_stages(tmp_path):
    done = subprocess.run([sys.executable, "launch/gpu_check.py", str(tmp_path), "--dry-run", "--stages", "nope"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown stage(s) ['nope']" in done.stderr


def test_carried_wheels_go_on_the_path(tmp_path, monkeypatch):
    """What the machine lacks (DeepSpeed for the end-to-end stage) comes as wheels in wheels/, first
    on the path (the carried set was resolved together)."""
    gpu_check = launch_script("gpu_check")
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
