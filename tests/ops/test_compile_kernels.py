"""The offline compile gate: Triton's compiler and ptxas for a GPU this machine need not have.

Compiling is slow (seconds per config), so CI covers the main cases only, first config, bfloat16, head dim 128
(Qwen3-8B): the target's causal varlen kernels and the delta preprocess on sm_90a, and the drafter's sliding block
forward and own-block backward on sm_120a (the forward at head dim 256 too). Every case is
`python launch/compile_kernels.py` (tables in docs/BENCHMARKS.md)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real JIT functions
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def test_gate_reports_each_kernel_and_config():
    cmd = [sys.executable, "launch/compile_kernels.py", "--op", "varlen", "--causal-only", "--first-only", "--arch",
           "90", "--head-dim", "128", "--dtype", "bfloat16", "--jobs", "2", "--json", "-"]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    records = json.loads(done.stdout)
    # dK/dV twice: with dQ fused (atomics) and without (deterministic)
    kernels = ["_bwd_dkdv_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_delta_kernel", "_fwd_kernel"]
    assert sorted(r["kernel"] for r in records) == kernels
    fields = {"kernel", "arch", "head_dim", "dtype", "config", "shared_bytes", "registers", "spills", "fits"}
    for r in records:
        assert fields <= set(r)
        assert (r["arch"], r["head_dim"], r["dtype"]) == ("sm_90a", 128, "bfloat16")
        assert 0 < r["shared_bytes"] and 0 < r["registers"] <= 255
        assert r["fits"] == (r["shared_bytes"] <= 232448 and r["spills"] == 0)
    assert done.returncode == (0 if all(r["fits"] for r in records) else 1), done.stderr[-2000:]


def test_gate_covers_the_sliding_block_kernels():
    """The sliding-layer variants (causal in the block or not: the released DFlash2 drafters' layers
    are all sliding and bidirectional) of the block forward and own-block backward, whose code the
    variant changes, first config, bfloat16 head dim 128 (and the forward at 256), on sm_120a: the
    least shared memory of the GPUs, and mma.sync operands in registers (every config of the sliding
    forward spilled there before its output was kept in chunks of BLOCK_M head-dim columns). Every
    kernel, config and arch: docs/BENCHMARKS.md."""
    cmd = [sys.executable, "launch/compile_kernels.py", "--op", "block", "--sliding-only", "--first-only", "--arch",
           "120", "--head-dim", "128", "--dtype", "bfloat16", "--kernel", "_fwd_kernel", "_bwd_own_kernel",
           "--jobs", "2", "--json", "-"]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    records = json.loads(done.stdout)
    assert sorted(r["kernel"] for r in records) == ["_bwd_own_kernel"] * 2 + ["_fwd_kernel"] * 2
    assert {(r["constexprs"]["HAS_WINDOW"], r["constexprs"]["CAUSAL"]) for r in records} == {(True, True),
                                                                                          (True, False)}
    for r in records:
        assert r["arch"] == "sm_120a" and 0 < r["shared_bytes"] and 0 < r["registers"] <= 255
    assert [r for r in records if not r["fits"]] == []
    assert done.returncode == 0, done.stderr[-2000:]
    # Head dim 256 (32-row groups): the forward's batched accumulator (every config spilled with two
    # half-head-dim ones), DFlash2's variant only: one compile.
    done = subprocess.run([sys.executable, "-c", D256], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout)
    assert record["chunks"] == 8 and record["arch"] == "sm_120a" and 0 < record["registers"] <= 255
    assert record["fits"], record


D256 = """
import json, torch
from dflash.ops.common.compile_check import compile_config
from dflash.ops.dflash_block.triton_kernels import _fwd_kernel, compile_cases

tuner, constexprs = compile_cases(256, 32, 8, torch.bfloat16, variants=((True, False),))[0]
assert tuner is _fwd_kernel
record = compile_config(tuner.fn, torch.bfloat16, constexprs, tuner.configs[0], 120)
print(json.dumps({**record, "chunks": constexprs["CHUNKS"]}))
"""


PRUNE = """
import torch
from dflash.errors import UserError
from dflash.ops.common import compile_check
from dflash.ops.varlen.triton_kernels import compile_cases

tuner, constexprs = compile_cases(128, 32, 8, torch.bfloat16, 90)[0]
tuner.configs = tuner.configs[:1]  # compiled (and cached on disk) by the gate test
record = compile_check.compile_config(tuner.fn, torch.bfloat16, constexprs, tuner.configs[0], 90)
assert compile_check.fitting_configs(tuner, torch.bfloat16, constexprs, 90) == tuner.configs
# The autotuner's own call, as at a launch on an sm_90a GPU (it also passes grid and warmup).
compile_check.current_capability = lambda: 90
nargs = {"Q": torch.empty(0, dtype=torch.bfloat16)}
assert tuner.early_config_prune(tuner.configs, nargs, grid=(1,), warmup=False, **constexprs) == tuner.configs
# What backend="auto" asks before it launches: the kernels of a causal, non-deterministic call.
from dflash.ops.varlen import triton_kernels as tk

for kernel in (tk._bwd_dkdv_kernel, tk._bwd_dq_kernel):
    kernel.configs = kernel.configs[:1]
assert tk.unservable(128, 32, 8, torch.bfloat16, True, False, 90) is None
compile_check.MAX_SHARED[90] = record["shared_bytes"] - 1
compile_check._fitting.cache_clear()
print("auto:", tk.unservable.__wrapped__(128, 32, 8, torch.bfloat16, True, False, 90))
try:
    compile_check.fitting_configs(tuner, torch.bfloat16, constexprs, 90)
except UserError as err:
    print(err)
"""


def test_configs_that_fit_are_kept_and_none_is_refused():
    done = subprocess.run([sys.executable, "-c", PRUNE], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "auto: _fwd_kernel: no config fits sm_90a (" in done.stdout
    assert "\n_fwd_kernel: no config fits sm_90a (" in done.stdout
