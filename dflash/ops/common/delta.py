"""delta = rowsum(dO * O), the softmax-Jacobian term of the attention backward, in one kernel
(eager torch would make three fp32 temporaries of the size of O)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import autotune, launch

ROWS = 64


@autotune({"num_warps": [4, 8], "num_stages": [1]}, ["D"], 'backend="torch"')
@triton.jit(do_not_specialize=["n_rows"])
def _delta_kernel(OUT, DO, DELTA, n_rows, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    # BLOCK consecutive (row, head) pairs of the (n_rows, H, D) inputs; delta is (H, n_rows).
    pairs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = pairs < n_rows * H
    offs = pairs[:, None] * D + tl.arange(0, D)[None, :]
    o = tl.load(OUT + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + (pairs % H) * n_rows + pairs // H, tl.sum(o * do, 1), mask=ok)


def attention_delta(do: torch.Tensor, o: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """(H, rows) fp32 rowsum(dO * O) of contiguous (rows, H, D) tensors (the kernels' lse layout);
    pinned: no timing-based config (deterministic mode)."""
    rows, heads, d = o.shape
    delta = torch.empty((heads, rows), dtype=torch.float32, device=o.device)
    launch(_delta_kernel, (triton.cdiv(rows * heads, ROWS),), (o, do, delta, rows), dict(H=heads, D=d, BLOCK=ROWS),
           pinned)
    return delta


def compile_cases(head_dim: int, heads: int) -> list:
    """(autotuned kernel, constexprs) as attention_delta calls it."""
    return [(_delta_kernel, {"H": heads, "D": head_dim, "BLOCK": ROWS})]
