"""What a kernel config costs on a GPU, found by compiling it, with or without that GPU.

Triton's compiler and ptxas (both in the triton wheel) turn a kernel and a config into a cubin
for any NVIDIA architecture, so shared memory, registers and spills are known offline:
`launch/compile_kernels.py` reports them for every kernel and config, and the autotuned kernels
prune, at their first launch, the configs that would not fit or would spill on the GPU they run on
(`fitting_configs`); configs that spill are kept only where every config spills.
"""
from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import tempfile
import warnings

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ...errors import UserError
from .backend import is_interpreting

# Shared memory one block may opt into (bytes): A100, H100/H200, B200, RTX PRO 6000 Blackwell.
# Triton compiles capability >= 90 for the "a" variants (sm_90a, sm_100a, sm_120a).
MAX_SHARED = {80: 166912, 90: 232448, 100: 232448, 120: 101376}
ARCH_NAMES = {80: "sm_80", 90: "sm_90a", 100: "sm_100a", 120: "sm_120a"}
_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
FP32_TENSORS = ("LSE", "DELTA", "DQ_ACC", "DBASE_PART", "PART_M", "PART_S", "PART_V", "GOLD", "TOP_V", "COEF")
# Set to pin every autotuned kernel to pinned_config (a quick GPU check: no timing).
PIN_ENV = "DFLASH_PIN_CONFIGS"


def signature(fn, dtype: torch.dtype) -> dict:
    """Triton signature of one of our kernels, from the naming convention of its arguments:
    LSE / DELTA / DQ_ACC are fp32 tensors, other UPPER-case names tensors of the inputs' dtype,
    *_scale fp32 scalars, n_* int32 scalars, other lower-case names int32 index tensors."""
    sig = {}
    for i, name in enumerate(fn.arg_names):
        if i in fn.constexprs:
            sig[name] = "constexpr"
        elif name in FP32_TENSORS:
            sig[name] = "*fp32"
        elif name.isupper():
            sig[name] = "*" + _TRITON_DTYPES[dtype]
        elif name.endswith("scale"):
            sig[name] = "fp32"
        elif name.startswith("n_"):
            sig[name] = "i32"
        else:
            sig[name] = "*i32"
    return sig


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of the kernel in `cubin`, read by cuobjdump. Our kernels hold no
    local arrays, so a stack frame is register spill space."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return int(match.group(1)), int(match.group(2))


@functools.cache
def _compile(fn, dtype, constexprs: tuple, num_warps: int, num_stages: int, cap: int) -> dict:
    sig = signature(fn, dtype)
    # As launched: torch's allocations are 16-byte aligned, and Triton specializes on that.
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if sig[name].startswith("*")}
    src = ASTSource(fn, sig, dict(constexprs), aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", cap, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    registers, spills = _resources(kernel.asm["cubin"])
    return {"shared_bytes": kernel.metadata.shared, "registers": registers, "spills": spills}


def config_name(config) -> str:
    tiles = ",".join(f"{k}={v}" for k, v in sorted(config.kwargs.items()))
    return f"{tiles}{',' if tiles else ''}warps={config.num_warps},stages={config.num_stages}"


def compile_config(fn, dtype: torch.dtype, constexprs: dict, config, cap: int) -> dict:
    """One record: what `config` of `fn` (a @triton.jit function) costs on compute capability `cap`."""
    res = _compile(fn, dtype, tuple(sorted({**constexprs, **config.kwargs}.items())), config.num_warps,
                   config.num_stages, cap)
    fits = res["shared_bytes"] <= MAX_SHARED.get(cap, MAX_SHARED[120]) and res["spills"] == 0
    return {"kernel": fn.__name__, "arch": ARCH_NAMES.get(cap, f"sm_{cap}"), "config": config_name(config),
            **res, "fits": fits}


def current_capability() -> int:
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def expected_speed(config) -> tuple:
    """Sort key of a config, fastest expected last: the larger tuned tile (more reuse of each
    load), then more pipeline stages (more loads in flight), then more warps."""
    return math.prod(config.kwargs.values()), config.num_stages, config.num_warps


def _launchable(tuner, dtype, constexprs: tuple, cap: int, configs):
    """(spill bytes, config) of those of `configs` that fit in shared memory on `cap`, compiled in turn
    (a generator: a caller that stops early compiles no further)."""
    for config in configs:
        record = compile_config(tuner.fn, dtype, dict(constexprs), config, cap)
        if record["shared_bytes"] <= MAX_SHARED.get(cap, MAX_SHARED[120]):
            yield record["spills"], config


@functools.cache
def _fitting(tuner, dtype, constexprs: tuple, cap: int) -> tuple:
    """(configs, spill bytes of each): those that fit without spilling; failing that, those that fit
    in shared memory with the fewest spills (slow but correct); empty when none can launch."""
    launchable = list(_launchable(tuner, dtype, constexprs, cap, tuner.configs))
    if not launchable:
        return ()
    least = min(spills for spills, _ in launchable)
    return tuple(config for spills, config in launchable if spills == least), least


@functools.cache
def _pinned(tuner, dtype, constexprs: tuple, cap: int) -> tuple:
    """(config, spill bytes): the first of the configs in order of expected speed that fits without
    spilling (compiled until found); failing that the least-spilling one; empty when none can launch."""
    ranked = sorted(tuner.configs, key=expected_speed, reverse=True)
    for spills, config in _launchable(tuner, dtype, constexprs, cap, ranked):
        if spills == 0:
            return config, 0
    found = _fitting(tuner, dtype, constexprs, cap)
    return (found[0][0], found[1]) if found else ()


def _found(tuner, dtype: torch.dtype, constexprs: dict, cap: int, found: tuple):
    arch = ARCH_NAMES.get(cap, f"sm_{cap}")
    if not found:
        raise UserError(f"{tuner.fn.__name__}: no config fits {arch} "
                        f"({MAX_SHARED.get(cap, MAX_SHARED[120])} B shared memory per block) for "
                        f"{dtype} and {dict(constexprs)}")
    if found[1]:
        warnings.warn(f"{tuner.fn.__name__}: every config spills registers on {arch} for {dtype} and "
                      f"{dict(constexprs)} (least: {found[1]} B); it runs, slowly", stacklevel=3)
    return found[0]


def fitting_configs(tuner, dtype: torch.dtype, constexprs: dict, cap: int | None = None) -> list:
    """The configs of `tuner` (a triton.autotune object) that fit in shared memory and do not spill
    on capability `cap` (default: the current GPU). When every config spills, the ones that spill
    least, with a warning. Raises UserError when none fits in shared memory (the launch would fail)."""
    cap = current_capability() if cap is None else cap
    return list(_found(tuner, dtype, constexprs, cap, _fitting(tuner, dtype, tuple(sorted(constexprs.items())), cap)))


def pinned_config(tuner, dtype: torch.dtype, constexprs: dict, cap: int | None = None):
    """The config of `tuner` that deterministic mode and DFLASH_PIN_CONFIGS=1 run, chosen without
    timing: the fastest expected (expected_speed) of those that fit `cap` (default: the current GPU)
    without spilling; where every config spills, the least spilling (with a warning). The same in
    every process. Under the interpreter (nothing to compile for) the fastest expected."""
    if is_interpreting():
        return max(tuner.configs, key=expected_speed)
    cap = current_capability() if cap is None else cap
    return _found(tuner, dtype, constexprs, cap, _pinned(tuner, dtype, tuple(sorted(constexprs.items())), cap))
