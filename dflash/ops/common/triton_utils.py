"""Launch settings shared by the Triton kernels."""
from __future__ import annotations

import torch
import triton

from ...errors import UserError
from .backend import is_interpreting

LOG2E = 1.4426950408889634


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


def autotune(options: dict, key: list, fallback: str):
    """triton.autotune over `options`, pruned at the first launch of each key to the configs that fit
    the GPU in shared memory without spilling (common.compile_check). When none does, the error
    names `fallback`, a backend that serves the case."""

    def wrap(fn):
        def prune(configs, nargs, **kwargs):
            from .compile_check import FP32_TENSORS, fitting_configs

            # kwargs also hold the launch's own keywords (grid, warmup)
            constexprs = {name: value for name, value in kwargs.items()
                          if name in fn.arg_names and fn.arg_names.index(name) in fn.constexprs}
            try:
                data = next(name for name in fn.arg_names if name.isupper() and name not in FP32_TENSORS)
                return fitting_configs(tuner, nargs[data].dtype, constexprs)
            except UserError as err:
                raise UserError(f"{err}; use {fallback}") from None

        tuner = triton.autotune(configs=autotune_configs(options), key=key,
                                prune_configs_by={"early_config_prune": prune})(fn)
        return tuner

    return wrap


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
    """What the kernels support beyond the public checks: dtype and head_dim."""
    if q.dtype == torch.float64:
        raise TypeError('the Triton kernels take float32, bfloat16 or float16; use backend="torch" for float64')
    d = q.shape[-1]
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"the Triton kernels need a power-of-two head_dim in [16, 256], got {d}")

