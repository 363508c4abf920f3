"""The DFlash2 block convolution: the Triton kernels (in the interpreter) and the recomputing CPU path
against the reference (`block_conv/naive.py`, today's math) in float64, output and every gradient; what
each keeps for backward; the first call after autotuning."""
import pytest
import torch

from dflash.ops.block_conv import block_conv
from dflash.ops.block_conv import triton_kernels as ck
from dflash.ops.block_conv.naive import block_conv_naive

from .conftest import DEVICE


def conv_inputs(blocks, block_size, hidden, taps, group, dtype=torch.float32, seed=0, dyn_stride=False):
    g = torch.Generator().manual_seed(seed)
    rows = blocks * block_size
    x = torch.randn(rows, hidden, generator=g)
    if dyn_stride:  # a slice of the kernel projection's output, as the drafter passes it
        dyn = torch.randn(rows, 2, taps, hidden // group, generator=g)[:, 1]
    else:
        dyn = torch.randn(rows, taps, hidden // group, generator=g)
    base = torch.randn(taps, hidden, generator=g)
    do = torch.randn(rows, hidden, generator=g)
    return [t.to(DEVICE, dtype) for t in (x, dyn)] + [base.to(DEVICE), do.to(DEVICE, dtype)]


def run(fn, x, dyn, base, do, *args, **kwargs):
    leaves = [t.detach().requires_grad_() for t in (x, dyn, base)]
    out = fn(*leaves, *args, **kwargs)
    return out, torch.autograd.grad(out, leaves, do.to(out.dtype))


def reference(x, dyn, base, do, block_size, group):
    """The reference in float64 (the high-precision answer) and in the inputs' dtype (what the dtype costs)."""
    high = run(block_conv_naive, x.double(), dyn.double(), base.double(), do.double(), block_size, group)
    low = run(block_conv_naive, x, dyn, base, do, block_size, group)
    return high, low


CASES = [pytest.param(3, 4, 64, 2, 8, id="odd-blocks-K2-G8"),
         pytest.param(5, 16, 96, 1, 16, id="K1-G16-H96"),
         pytest.param(7, 5, 48, 4, 16, id="K4-B5-G16-H48"),
         pytest.param(3, 16, 192, 4, 64, id="K4-G64-H192"),
         pytest.param(1, 3, 72, 4, 8, id="K-past-B-H72"),
         pytest.param(9, 10, 128, 2, 64, id="B10-G64-H128")]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("blocks,block_size,hidden,taps,group", CASES)
def test_block_conv_matches_the_reference(check_close, backend, blocks, block_size, hidden, taps, group):
    x, dyn, base, do = conv_inputs(blocks, block_size, hidden, taps, group, dyn_stride=True)
    out, grads = run(block_conv, x, dyn, base, do, block_size, group, backend=backend)
    (ref, ref_grads), (low, low_grads) = reference(x, dyn, base, do, block_size, group)
    for name, got, want, lo in zip(("out", "dx", "ddynamic", "dbase"), (out, *grads), (ref, *ref_grads),
                                   (low, *low_grads), strict=True):
        assert got.shape == want.shape and got.dtype == lo.dtype, name
        check_close(name, got, want.to(got.dtype), lo)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_block_conv_triton_in_half_precision(check_close, dtype):
    """fp32 inside the kernels: at least as close to the float64 answer as the reference in the dtype."""
    x, dyn, base, do = conv_inputs(5, 16, 128, 2, 16, dtype)
    out, grads = run(block_conv, x, dyn, base, do, 16, 16, backend="triton")
    (ref, ref_grads), (low, low_grads) = reference(x, dyn, base, do, 16, 16)
    for name, got, want, lo in zip(("out", "dx", "ddynamic", "dbase"), (out, *grads), (ref, *ref_grads),
                                   (low, *low_grads), strict=True):
        check_close(name, got.float(), want.float(), lo.float())


def _saved_bytes(fn, *args, **kwargs):
    """Bytes of the tensors autograd keeps for backward (distinct storages)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return sum(storages.values())


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_block_conv_keeps_only_its_inputs(backend):
    """The reference keeps a weight factor and a shifted input per tap (about 2K hidden-size tensors);
    the op keeps x, the dynamic weights' storage and the base kernel, whatever K."""
    x, dyn, base, _ = conv_inputs(4, 16, 64, 4, 16, dyn_stride=True)
    leaves = [t.requires_grad_() for t in (x, dyn, base)]
    inputs = x.nbytes + dyn.untyped_storage().nbytes() + base.nbytes
    assert _saved_bytes(block_conv, *leaves, 16, 16, backend=backend) <= inputs + base.nbytes  # (+ base in x's dtype)
    assert _saved_bytes(block_conv_naive, *leaves, 16, 16) > 4 * x.nbytes


def test_block_conv_backward_is_split_over_rows():
    """The interpreter's splits are small, so the tests above sum the base gradient over several."""
    assert ck.splits(7 * 16)[0] > 1


def test_block_conv_refuses_bad_shapes():
    x, dyn, base, _ = conv_inputs(2, 4, 64, 2, 8)
    with pytest.raises(ValueError, match="multiple of block_size"):
        block_conv(x[:7], dyn[:7], base, 4, 8)
    with pytest.raises(ValueError, match="does not divide"):
        block_conv(x, dyn, base, 4, 12)
    with pytest.raises(ValueError, match="dynamic must be"):
        block_conv(x, dyn[:, :1], base, 4, 8)
    with pytest.raises(TypeError, match="share a float dtype"):
        block_conv(x, dyn.double(), base, 4, 8)


@pytest.mark.skipif(DEVICE == "cuda", reason="simulates a GPU's autotuner in the interpreter")
def test_first_block_conv_call_after_autotuning_matches_the_reference(monkeypatch, check_close):
    """The autotuner runs each config several times on the live buffers before the real launch: the
    kernels accumulate into nothing across launches (the base gradient's partial sums are stored), so
    the first call is right with nothing in reset_to_zero."""
    import triton

    from .test_kernel_contracts import _simulate_gpu_tuning

    kernels = [ck._fwd_kernel, ck._bwd_kernel]
    configs = {k: [triton.Config({"BLOCK_R": r}, num_warps=4, num_stages=1) for r in (8, 16)] for k in kernels}
    calls = _simulate_gpu_tuning(monkeypatch, kernels, [2.0, 1.0], configs)
    assert all(not k.reset_to_zero for k in kernels)
    x, dyn, base, do = conv_inputs(7, 16, 64, 2, 16)
    out, grads = run(block_conv, x, dyn, base, do, 16, 16, backend="triton")
    assert calls[ck._bwd_kernel] == 2 and calls[ck._fwd_kernel] == 2
    (ref, ref_grads), _ = reference(x, dyn, base, do, 16, 16)
    for name, got, want in zip(("out", "dx", "ddynamic", "dbase"), (out, *grads), (ref, *ref_grads), strict=True):
        check_close(name, got, want.float())
