"""Gated DeltaNet ops on packed rows: the references against independent per-sample computations
(torch's conv1d; transformers' chunked delta rule), no state or window crossing a sample boundary,
and flash-linear-attention's kernels against the references where they run (CUDA + fla)."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from dflash.ops import causal_conv1d_varlen, gated_delta_rule_varlen

from .conftest import DEVICE

LENGTHS = [70, 1, 0, 5, 130, 3]  # past one 64-token chunk and two, one token, empty


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def _spans(lengths):
    bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def test_conv_restarts_at_every_sample():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(sum(LENGTHS), 12, generator=g), torch.randn(12, 4, generator=g), torch.randn(12, generator=g)
    out = causal_conv1d_varlen(x, w, b, _cu(LENGTHS).cpu(), "silu", backend="torch")
    for s, e in _spans(LENGTHS):  # each sample alone through torch's own depthwise conv
        if e == s:
            continue
        want = F.silu(F.conv1d(x[s:e].t()[None], w[:, None], b, padding=3, groups=12)[0, :, : e - s].t())
        torch.testing.assert_close(out[s:e], want)


def _delta_inputs(lengths, hk=2, hv=4, dk=16, dv=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k = (torch.randn(t, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=g)
    decay = -F.softplus(torch.randn(t, hv, generator=g))  # log decay <= 0
    beta = torch.rand(t, hv, generator=g)
    return [x.to(DEVICE, dtype) for x in (q, k, v)] + [decay.to(DEVICE), beta.to(DEVICE, dtype)]


def test_delta_rule_reference_matches_transformers_chunked_form_per_sample():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, decay, beta = (x.cpu() for x in _delta_inputs(LENGTHS))
    out = gated_delta_rule_varlen(q, k, v, decay, beta, _cu(LENGTHS).cpu(), use_qk_l2norm=True, backend="torch")
    for s, e in _spans(LENGTHS):
        if e == s:
            continue
        # key heads repeated for the value heads, as Qwen3.5's layer does before the call (transformers 5.19's
        # function takes equal heads only)
        rep = v.shape[-2] // q.shape[-2]
        qs, ks = (x[None, s:e].repeat_interleave(rep, dim=-2) for x in (q, k))
        want, _ = torch_chunk_gated_delta_rule(qs, ks, v[None, s:e], g=decay[None, s:e], beta=beta[None, s:e],
                                               use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[s:e], want[0], rtol=1e-4, atol=1e-5)


def test_delta_rule_state_does_not_cross_samples():
    """A sample's output is the same whatever precedes it in the pack."""
    q, k, v, decay, beta = (x.cpu() for x in _delta_inputs([40, 25], seed=3))
    both = gated_delta_rule_varlen(q, k, v, decay, beta, _cu([40, 25]).cpu(), backend="torch")
    alone = gated_delta_rule_varlen(*(x[40:] for x in (q, k, v, decay, beta)), _cu([25]).cpu(), backend="torch")
    torch.testing.assert_close(both[40:], alone, rtol=0, atol=0)


@pytest.mark.skipif(DEVICE != "cuda" or importlib.util.find_spec("fla") is None,
                    reason="flash-linear-attention kernels need CUDA and the fla extra")
def test_fla_kernels_match_the_references():
    cu = _cu(LENGTHS)
    q, k, v, decay, beta = _delta_inputs(LENGTHS, dtype=torch.bfloat16)
    out = gated_delta_rule_varlen(q, k, v, decay, beta, cu, use_qk_l2norm=True, backend="fla")
    ref = gated_delta_rule_varlen(*(x.float() for x in (q, k, v, decay, beta)), cu, use_qk_l2norm=True,
                                  backend="torch")
    assert (out.float() - ref).norm() / ref.norm() < 2e-2
    x, w = torch.randn(sum(LENGTHS), 64, device=DEVICE, dtype=torch.bfloat16), torch.randn(64, 4, device=DEVICE)
    out = causal_conv1d_varlen(x, w.to(x.dtype), None, cu, "silu", backend="fla")
    ref = causal_conv1d_varlen(x.float(), w, None, cu, "silu", backend="torch")
    assert (out.float() - ref).norm() / ref.norm() < 2e-2


def test_bad_inputs_are_named():
    q, k, v, decay, beta = (x.cpu() for x in _delta_inputs([5]))
    with pytest.raises(ValueError, match=r"g and beta must be \(T, Hv\)"):
        gated_delta_rule_varlen(q, k, v, decay[:, :2], beta, _cu([5]).cpu())
    with pytest.raises(ValueError, match="backend"):
        gated_delta_rule_varlen(q, k, v, decay, beta, _cu([5]).cpu(), backend="cuda")
    if importlib.util.find_spec("fla") is None:
        with pytest.raises(RuntimeError, match=r"dflash\[fla\]"):
            gated_delta_rule_varlen(q, k, v, decay, beta, _cu([5]).cpu(), backend="fla")
