"""The scripts a lent GPU machine runs, run here on the CPU so that they cannot rot: the one-shot GPU
check (tiny shapes, Triton interpreter) and the kernel benchmark's promise to keep what it measured
when it is cut short."""
import json
import os
import signal
import subprocess
import sys
import time
import zipfile

import pytest

from .conftest import ROOT


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def test_gpu_check_dry_run(tmp_path):
    """The whole script as the GPU machine runs it (gpu_check.sh: no install, PYTHONPATH=$PWD),
    with --dry-run: every stage writes its JSON and passes."""
    out = tmp_path / "out"
    done = subprocess.run(["bash", "launch/gpu_check.sh", str(out), "--dry-run"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "all passed" in (out / "log.txt").read_text()
    env = json.loads((out / "env.json").read_text())
    assert env["interpreter"] and env["torch"] and env["triton"]
    summary = json.loads((out / "summary.json").read_text())
    assert {name: s["passed"] for name, s in summary["stages"].items()} == {"correctness": True, "kernels": True}
    checks = json.loads((out / "correctness.json").read_text())["checks"]
    seen = {(c["op"], c["mode"], c["call"]) for c in checks if c["passed"]}
    assert seen == {(op, mode, call) for op in ("varlen", "block") for mode in ("atomic", "deterministic")
                    for call in ("first call", "second call")}
    assert all(c["bitwise_equal_to_first_call"] for c in checks if c["mode"] == "deterministic" and
               c["call"] == "second call")
    bench = json.loads((out / "bench_kernels.json").read_text())
    for case in ("seed-like/sorted", "seed-like/shuffled"):
        for op in ("varlen", "block"):
            ours = bench["results"][case][op]["dflash-triton"]
            assert ours["fwd_ms"] > 0 and ours["fwdbwd_ms"] > 0


def test_gpu_check_refuses_unknown_stages(tmp_path):
    done = subprocess.run([sys.executable, "launch/gpu_check.py", str(tmp_path), "--dry-run", "--stages", "nope"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown stage(s) ['nope']" in done.stderr


def test_carried_wheels_go_on_the_path(tmp_path, monkeypatch):
    """What the machine lacks (DeepSpeed for the end-to-end stage) comes as wheels in wheels/."""
    sys.path.insert(0, str(ROOT / "launch"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "launch"))
    with zipfile.ZipFile(tmp_path / "carried_pkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("carried_pkg/__init__.py", "ANSWER = 42\n")
        z.writestr("carried_pkg-1.0.dist-info/METADATA", "Name: carried-pkg\nVersion: 1.0\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert gpu_check.use_carried_wheels(tmp_path) == ["carried_pkg-1.0-py3-none-any.whl"]
    import carried_pkg

    assert carried_pkg.ANSWER == 42
    sys.modules.pop("carried_pkg")
    assert gpu_check.use_carried_wheels(tmp_path / "none") == []


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
