"""Inputs and runs shared by the attention-op tests (test_dflash_block_attention, test_varlen_attention,
test_kernel_contracts): packed batches with their gradients, forward + backward through an op."""
import torch

from dflash.ops import dflash_block_attention, varlen_attention

from .conftest import DEVICE


def block_batch(lengths, blocks_per_seq, block_size, hq, hkv, d, dtype, seed=0, anchors=None):
    """Packed context of `lengths`, blocks with random anchors in [0, length] in shuffled order
    (or the given (sample, anchor) pairs), random q/k/v and output gradient."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    if anchors is None:
        anchors = [(s, int(torch.randint(0, n + 1, (1,), generator=g))) for s, n in enumerate(lengths)
                   for _ in range(blocks_per_seq)]
        anchors = [anchors[i] for i in torch.randperm(len(anchors), generator=g).tolist()]
    seq = torch.tensor([s for s, _ in anchors], dtype=torch.int32)
    anchor = torch.tensor([a for _, a in anchors], dtype=torch.int32)
    rows, t = len(anchors) * block_size, sum(lengths)
    tensors = [torch.randn(n, h, d, generator=g) for n, h in
               ((rows, hq), (t, hkv), (t, hkv), (rows, hkv), (rows, hkv), (rows, hq))]
    tensors = [x.to(DEVICE, dtype) for x in tensors]
    return tensors[:5], tensors[5], cu.to(DEVICE), seq.to(DEVICE), anchor.to(DEVICE)


def run_block(inputs, do, cu, seq, anchor, block_size, backend, dtype=None, deterministic=None, window=None,
              causal=False):
    leaves = [x.to(dtype or x.dtype).requires_grad_() for x in inputs]
    out = dflash_block_attention(*leaves, cu, seq, anchor, block_size, backend=backend, deterministic=deterministic,
                                 window=window, causal=causal)
    return out, torch.autograd.grad(out, leaves, do.to(out.dtype))


def cu_seqlens(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def varlen_inputs(lengths, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v, do = (torch.randn(t, h, d, generator=g).to(DEVICE, dtype) for h in (hq, hkv, hkv, hq))
    return q, k, v, do


def run_varlen(q, k, v, do, cu, max_len, causal, backend, dtype=None, deterministic=None):
    """Output and (dq, dk, dv), computed on copies cast to `dtype` (default: the inputs')."""
    leaves = [x.to(dtype or x.dtype).requires_grad_() for x in (q, k, v)]
    out = varlen_attention(*leaves, cu, max_len, causal=causal, backend=backend, deterministic=deterministic)
    return out, torch.autograd.grad(out, leaves, do.to(out.dtype))
