"""Launch settings shared by the Triton kernels."""
from __future__ import annotations

import os

import torch
import triton

from ...errors import UserError
from .backend import is_interpreting

LOG2E = 1.4426950408889634
MAX_TILE_ROWS = 256  # no tile of any kernel has more rows (bounds the offsets past a sample's end)


def _fix_interpreter_bf16_dot() -> None:
    """Triton's numpy interpreter keeps bfloat16 as raw uint16 bits and its tl.dot multiplies
    those integers (seen in triton 3.9): widen bf16 operands to fp32 (exact) first."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot
    if getattr(create_dot, "_dflash_bf16", False):
        return

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    patched._dflash_bf16 = True
    interpreter.InterpreterBuilder.create_dot = patched


if is_interpreting():
    _fix_interpreter_bf16_dot()


def autotune_configs(options: dict) -> list:
    """Every combination of `options` ({name: values}, plus num_warps / num_stages) as configs.

    The numpy interpreter would time each config at numpy speed, so it gets the first only.
    """
    names = [n for n in options if n not in ("num_warps", "num_stages")]
    combos = [{}]
    for name in names:
        combos = [{**c, name: value} for c in combos for value in options[name]]
    configs = [triton.Config(c, num_warps=w, num_stages=s)
               for c in combos for w in options["num_warps"] for s in options["num_stages"]]
    return configs[:1] if is_interpreting() else configs


def autotune(options: dict, key: list, fallback: str, reset_to_zero: list | None = None,
             restore_value: list | None = None):
    """triton.autotune over `options`, pruned at the first launch of each key to the configs that fit
    the GPU in shared memory without spilling (common.compile_check). When none does, the error
    names `fallback`, a backend that serves the case. `reset_to_zero`: the buffers the kernel
    accumulates into; on a GPU the autotuner runs every config on the live buffers (many times)
    before the real launch, and zeroes these after each run and before that launch. `restore_value`: the
    buffers a kernel updates in place, copied before each timed run and put back after it."""

    def wrap(fn):
        def prune(configs, nargs, **kwargs):
            from .compile_check import fitting_configs

            # kwargs also hold the launch's own keywords (grid, warmup)
            constexprs = {name: value for name, value in kwargs.items()
                          if name in fn.arg_names and fn.arg_names.index(name) in fn.constexprs}
            try:
                data = next(name for name in fn.arg_names if _is_data(name))
                return fitting_configs(tuner, nargs[data].dtype, constexprs)
            except UserError as err:
                raise UserError(f"{err}; use {fallback}") from None

        tuner = triton.autotune(configs=autotune_configs(options), key=key, reset_to_zero=reset_to_zero,
                                restore_value=restore_value, prune_configs_by={"early_config_prune": prune})(fn)
        tuner.fallback = fallback
        return tuner

    return wrap


def offsets_need_int64(longest: int, heads: int, head_dim: int) -> bool:
    """Whether offsets inside one sample (row * heads * head_dim, rows up to two tiles past its end)
    can pass int32: from a sample of 512K rows at 32 heads x 128. The kernels then compute them in
    int64 (OFFS64: more registers, slower, may spill) for that batch only."""
    return (longest + 2 * MAX_TILE_ROWS) * heads * head_dim >= 2**31


def pin_configs() -> bool:
    """DFLASH_PIN_CONFIGS=1: every kernel runs its pinned config (no timing: a quick GPU check)."""
    from .compile_check import PIN_ENV

    return os.environ.get(PIN_ENV, "0") not in ("", "0")


def launch(tuner, grid: tuple, args: tuple, constexprs: dict, pinned: bool = False):
    """Launch the autotuned kernel `tuner` on `grid` with positional `args` and `constexprs`.

    pinned (deterministic mode, or DFLASH_PIN_CONFIGS=1): no timing. The kernel runs the config
    expected fastest among those that fit this GPU (compile_check.pinned_config), so two processes
    run the same config and give the same bits; the autotuner's choice depends on timings."""
    if not (pinned or pin_configs()):
        return tuner[grid](*args, **constexprs)
    from .compile_check import pinned_config

    data = next(a for name, a in zip(tuner.fn.arg_names, args, strict=False) if _is_data(name))
    try:
        config = pinned_config(tuner, data.dtype, constexprs)
    except UserError as err:
        raise UserError(f"{err}; use {tuner.fallback}") from None
    return tuner.fn[grid](*args, **constexprs, **config.all_kwargs())


def _is_data(name: str) -> bool:
    """Whether kernel argument `name` is a tensor of the inputs' dtype (compile_check.signature)."""
    from .compile_check import FP32_TENSORS

    return name.isupper() and name not in FP32_TENSORS


def size_bucket(rows: int) -> int:
    """The size class of a launch, an autotune key: the power of two at or above `rows`, from 4,096
    (tiny batches share one class) to 2**20. Without it the first batch, however small, would
    fix the configs for good; with it each class is tuned once (at most nine classes)."""
    return min(max(4096, 1 << max(rows - 1, 0).bit_length()), 1 << 20)


def tile_rows(full: int, head_dim: int, dtype: torch.dtype, row_bytes: int = 256) -> int:
    """Rows of a tile that shapes a tile list: `full`, halved for every doubling of the row size
    past `row_bytes` (by default float32 at head dim 128 and any dtype at 256 get half, float32 at
    256 a quarter), down to 16, where no config of the larger tile fits or avoids spilling
    (launch/compile_kernels.py)."""
    rows, size = full, head_dim * dtype.itemsize
    while not is_interpreting() and size > row_bytes and rows > 16:
        rows, size = rows // 2, size // 2
    return rows


def check_triton_inputs(q) -> None:
    """What the kernels support beyond the public checks: dtype, head_dim, rows x heads."""
    if q.shape[0] * q.shape[1] >= 2**31:  # lse and delta are (heads, rows), indexed in int32
        raise ValueError(f"the Triton kernels take fewer than 2**31 rows x query heads, got {q.shape[0]} x "
                         f"{q.shape[1]}; split the micro-batch")
    if q.dtype == torch.float64:
        raise TypeError('the Triton kernels take float32, bfloat16 or float16; use backend="torch" for float64')
    d = q.shape[-1]
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"the Triton kernels need a power-of-two head_dim in [16, 256], got {d}")

