"""delta = rowsum(dO * O), the softmax-Jacobian term of the attention backward, in one kernel
(eager torch would make three fp32 temporaries of the size of O)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import autotune

ROWS = 64


@autotune({"num_warps": [4, 8], "num_stages": [1]}, ["D"], 'backend="torch"')
@triton.jit(do_not_specialize=["n_rows"])
def _delta_kernel(OUT, DO, DELTA, n_rows, D: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n_rows
    offs = rows[:, None] * D + tl.arange(0, D)[None, :]
    o = tl.load(OUT + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, 1), mask=ok)


def attention_delta(do: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """(rows, H) fp32 rowsum(dO * O) of contiguous (rows, H, D) tensors."""
    delta = torch.empty(o.shape[:2], dtype=torch.float32, device=o.device)
    n_rows = o.shape[0] * o.shape[1]
    _delta_kernel[(triton.cdiv(n_rows, ROWS),)](o, do, delta, n_rows, D=o.shape[2], BLOCK=ROWS)
    return delta


def compile_cases(head_dim: int) -> list:
    """(autotuned kernel, constexprs) as attention_delta calls it."""
    return [(_delta_kernel, {"D": head_dim, "BLOCK": ROWS})]
