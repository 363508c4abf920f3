"""The frozen head's fused statistics and in-place backward (Triton in the interpreter) against the torch
reference (`head_topk/naive.py`, the loss room's own arithmetic on an fp32 copy)."""
import pytest
import torch

from dflash.ops.head_topk import head_topk, head_topk_backward_
from dflash.ops.head_topk import triton_kernels as hk
from dflash.ops.head_topk.naive import head_topk_backward_naive_, head_topk_naive, mapped

from .conftest import DEVICE


def head_inputs(rows, vocab, dtype, seed=0, spread=4.0):
    g = torch.Generator().manual_seed(seed)
    logits = (spread * torch.randn(rows, vocab, generator=g)).to(DEVICE, dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    coef = torch.rand(rows, generator=g).to(DEVICE)
    coef[::3] = 0.0  # rows of weight 0: no gradient
    return logits, labels, coef


MAPS = [pytest.param(1.0, None, id="plain"), pytest.param(0.7, None, id="scaled"),
        pytest.param(0.7, 3.0, id="softcap")]
CASES = [pytest.param(3, 300, 16, 0.7, 3.0, id="V300-K16-softcap"),
         pytest.param(3, 300, 16, 1.0, None, id="V300-K16-plain"),
         pytest.param(2, 77, 1, 0.7, None, id="V77-K1-scaled"),
         pytest.param(5, 333, 5, 0.7, 3.0, id="rows5-V333-K5-softcap"),
         pytest.param(2, 64, 0, 1.0, None, id="K0"),
         pytest.param(1, 40, 40, 0.7, 3.0, id="K=V")]


@pytest.mark.parametrize("rows,vocab,top_k,scale,softcap", CASES)
def test_head_stats_match_the_reference(rows, vocab, top_k, scale, softcap):
    logits, labels, _ = head_inputs(rows, vocab, torch.float32)
    got = head_topk(logits, labels, top_k, logit_scale=scale, softcap=softcap, backend="triton")
    lse, gold, argmax, values, ids = head_topk_naive(logits.double(), labels, top_k, scale, softcap)
    torch.testing.assert_close(got.lse, lse.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.gold, gold.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax, argmax)
    torch.testing.assert_close(got.top_values, values.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.top_ids, ids)  # distinct random values: one order
    assert got.top_ids.dtype == torch.int64 and got.top_values.shape == (rows, top_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_stats_of_half_precision_logits_keep_torch_topk_s_set(dtype):
    """Half-precision logits tie often: the values are torch.topk's, and among equal values the lower ids."""
    logits, labels, _ = head_inputs(3, 300, dtype)
    got = head_topk(logits, labels, 16, logit_scale=0.5, softcap=2.0, backend="triton")
    want = head_topk_naive(logits, labels, 16, 0.5, 2.0)
    torch.testing.assert_close(got.lse, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.top_values, want[3], rtol=1e-6, atol=1e-6)
    z = mapped(logits, 0.5, 2.0)
    assert torch.equal(got.argmax, z.argmax(-1))
    for r in range(z.shape[0]):
        order = sorted(range(z.shape[1]), key=lambda v: (-float(logits[r, v]), v))[:16]
        assert got.top_ids[r].tolist() == order


def test_ties_keep_the_lower_ids_across_splits():
    """Equal logits over several vocabulary splits (the interpreter's splits are 128 ids): the first ids win."""
    logits = torch.zeros(2, 300, device=DEVICE)
    logits[0, 250] = 1.0
    got = head_topk(logits, torch.zeros(2, dtype=torch.long, device=DEVICE), 4, backend="triton")
    assert hk.splits(2, 300)[0] > 1
    assert got.top_ids.tolist() == [[250, 0, 1, 2], [0, 1, 2, 3]] and got.argmax.tolist() == [250, 0]


@pytest.mark.parametrize("scale,softcap", MAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_overwrites_the_logits_with_their_gradient(check_close, scale, softcap, dtype):
    logits, labels, coef = head_inputs(5, 300, dtype)
    lse = head_topk_naive(logits, labels, 0, scale, softcap)[0]
    want = head_topk_backward_naive_(logits.double(), labels, lse.double(), coef.double(), scale, softcap)
    low = head_topk_backward_naive_(logits.clone(), labels, lse, coef, scale, softcap)
    buffer = logits.clone()
    got = head_topk_backward_(buffer, labels, lse, coef, logit_scale=scale, softcap=softcap, backend="triton")
    assert got.data_ptr() == buffer.data_ptr()  # in place
    check_close("dlogits", got, want.to(dtype), low)
    assert not got[::3].any()  # coef 0


def test_gradient_is_the_autograd_gradient_of_the_weighted_cross_entropy():
    """The reference itself: d/draw of sum_r coef_r (lse_r - z_r[label_r]) by autograd."""
    logits, labels, coef = head_inputs(4, 50, torch.float64)
    raw = logits.clone().requires_grad_()
    z = mapped(raw, 0.7, 3.0).double()
    (coef.double() * (torch.logsumexp(z, -1) - z.gather(1, labels[:, None]).squeeze(1))).sum().backward()
    lse = head_topk_naive(logits, labels, 0, 0.7, 3.0)[0]
    torch.testing.assert_close(head_topk_backward_naive_(logits.clone(), labels, lse, coef.double(), 0.7, 3.0),
                               raw.grad)


@pytest.mark.skipif(DEVICE == "cuda", reason="simulates a GPU's autotuner in the interpreter")
def test_first_head_calls_after_autotuning_match_the_reference(monkeypatch, check_close):
    """The backward updates the logits in place: the autotuner's timed runs of it would apply it again
    and again (restore_value puts the buffer back); the statistics accumulate nothing across launches."""
    import triton

    from .test_kernel_contracts import _simulate_gpu_tuning

    configs = {hk._stats_kernel: [triton.Config({"BLOCK_V": v}, num_warps=1, num_stages=1) for v in (32, 64)],
               hk._combine_kernel: [triton.Config({}, num_warps=w, num_stages=1) for w in (1, 4)],
               hk._grad_kernel: [triton.Config({"BLOCK_V": v}, num_warps=4, num_stages=1) for v in (64, 128)]}
    calls = _simulate_gpu_tuning(monkeypatch, list(configs), [2.0, 1.0], configs)
    assert hk._grad_kernel.restore_value == ["LOGITS"] and all(not k.reset_to_zero for k in configs)
    logits, labels, coef = head_inputs(2, 300, torch.float32)
    stats = head_topk(logits, labels, 8, logit_scale=0.7, softcap=3.0, backend="triton")
    buffer = head_topk_backward_(logits.clone(), labels, stats.lse, coef, logit_scale=0.7, softcap=3.0,
                                 backend="triton")
    assert all(calls[k] == 2 for k in configs)
    want = head_topk_naive(logits.double(), labels, 8, 0.7, 3.0)
    torch.testing.assert_close(stats.lse, want[0].float())
    assert torch.equal(stats.top_ids, want[4])
    check_close("dlogits", buffer, head_topk_backward_naive_(logits.double(), labels, want[0], coef.double(), 0.7,
                                                             3.0).float())


def test_head_refuses_bad_inputs():
    logits, labels, coef = head_inputs(3, 20, torch.float32)
    with pytest.raises(ValueError, match="top_k"):
        head_topk(logits, labels, 21)
    with pytest.raises(ValueError, match="labels"):
        head_topk(logits, labels[:2], 4)
    with pytest.raises(ValueError, match="logit_scale and softcap"):
        head_topk(logits, labels, 4, softcap=0.0)
    with pytest.raises(ValueError, match="contiguous"):
        head_topk(logits.t(), labels, 4)
