"""The reference: the DFlash2 block convolution as plain torch ops (autograd keeps, per tap, the
weight factor and a shifted copy of the input: the memory the op exists to avoid)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def block_conv_naive(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_size: int,
                     group_size: int) -> torch.Tensor:
    """x (NB*B, H) block-major, dynamic (NB*B, K, H/G), base (K, H) -> (NB*B, H):
    out[t, c] = sum_i (base[i, c] + dynamic[t, i, c // G]) x[t - i, c], zero where t - i leaves t's block.
    Computed in x's dtype, tap by tap (base cast to it first)."""
    n, hidden = x.shape
    groups = hidden // group_size
    xb = x.view(-1, block_size, groups, group_size)
    dyn = dynamic.view(-1, block_size, base.shape[0], groups, 1)
    out = torch.zeros_like(xb)
    for i in range(min(base.shape[0], block_size)):
        shifted = xb if i == 0 else F.pad(xb[:, :-i], (0, 0, 0, 0, i, 0))  # slot k reads slot k - i
        out = out + (base[i].view(groups, group_size).to(x.dtype) + dyn[:, :, i]) * shifted
    return out.view(n, hidden)
