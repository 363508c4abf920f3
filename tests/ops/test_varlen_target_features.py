"""varlen_attention for the targets' attention variants: sliding windows, attention sinks (gpt-oss)
and a value head dim other than the query's (MLA), in the reference against a dense float64
computation over the whole pack, and in the other backends against the reference."""
import pytest
import torch

from dflash.ops import varlen_attention

from .conftest import DEVICE


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def _inputs(lengths, hq, hkv, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k = (torch.randn(t, h, d, generator=g).to(DEVICE, dtype) for h in (hq, hkv))
    v = torch.randn(t, hkv, dv, generator=g).to(DEVICE, dtype)
    sinks = torch.randn(hq, generator=g).to(DEVICE, dtype)
    return q, k, v, sinks


def _dense(q, k, v, cu, window, sinks, scale):
    """Softmax over the whole pack with a tokens x tokens mask and a sink column (float64)."""
    t, hq, _ = q.shape
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1, device=q.device), (cu[1:] - cu[:-1]).long())
    pos = torch.arange(t, device=q.device)
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        mask &= pos[:, None] - pos[None, :] < window
    g = hq // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("ihd,jhd->hij", q.double(), k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(hq, 1, 1).expand(hq, t, 1)], -1)
    p = torch.softmax(s, -1)[..., :t]
    return torch.einsum("hij,jhd->ihd", p, v)


# (lengths, window): samples longer than the window, shorter, equal, one token, empty
CASES = [
    pytest.param([37, 1, 64, 5, 0, 20], 8, id="window8"),
    pytest.param([1, 1, 3], 2, id="one-token-window2"),
    pytest.param([30, 16, 17], 16, id="window-at-length"),
    pytest.param([25, 9], None, id="no-window"),
]


@pytest.mark.parametrize("sinks_on", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("lengths,window", CASES)
def test_reference_matches_dense_mask(lengths, window, sinks_on):
    q, k, v, sinks = _inputs(lengths, 4, 2, 24, 16, torch.float64)
    sinks = sinks if sinks_on else None
    cu = _cu(lengths)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = varlen_attention(*leaves, cu, max(lengths), window=window, sinks=sinks, backend="torch", softmax_scale=0.3)
    assert out.shape == (sum(lengths), 4, 16)
    torch.testing.assert_close(out, _dense(q, k, v, cu, window, sinks, 0.3))
    out.sum().backward()  # differentiable, sinks and windows included
    assert all(torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("lengths,window", CASES)
def test_flex_matches_reference(lengths, window, check_close):
    """FlexAttention (forward on the CPU): window in the mask, sinks from its log-sum-exp, its own Dv."""
    q, k, v, sinks = _inputs(lengths, 4, 2, 32, 16, torch.float32, seed=1)
    cu = _cu(lengths)
    ref = _dense(q, k, v, cu, window, sinks, 32 ** -0.5)
    out = varlen_attention(q, k, v, cu, max(lengths), window=window, sinks=sinks, backend="flex")
    check_close("out", out, ref, varlen_attention(q, k, v, cu, max(lengths), window=window, sinks=sinks,
                                                   backend="torch"))


@pytest.mark.parametrize("d,dv", [(24, 16), (64, 32), (32, 32)], ids=["d24-dv16", "d64-dv32", "d32"])
def test_triton_forward_pads_head_dims_and_folds_sinks(d, dv, check_close):
    """MLA-like head dims (q/k 24 or 64, v 16 or 32) run the kernels zero-padded to a power of two;
    sinks are folded in from the kernel's log-sum-exp."""
    lengths = [37, 1, 50, 0, 9]
    q, k, v, sinks = _inputs(lengths, 4, 2, d, dv, torch.float32, seed=d)
    cu = _cu(lengths)
    with torch.no_grad():
        for s in (None, sinks):
            out = varlen_attention(q, k, v, cu, 50, sinks=s, backend="triton")
            ref = varlen_attention(q.double(), k.double(), v.double(), cu, 50, sinks=None if s is None else s.double(),
                                   backend="torch")
            check_close("out", out, ref)
    with pytest.raises(NotImplementedError, match="forward only"):
        varlen_attention(q.requires_grad_(), k, v, cu, 50, sinks=sinks, backend="triton")


@pytest.mark.parametrize("lengths,window", CASES)
def test_triton_window_matches_reference(lengths, window, check_close):
    """The forward kernel's sliding window: key tiles before a row's window skipped, the rest masked
    (samples past the window span several 32-row tiles in the interpreter), with sinks."""
    q, k, v, sinks = _inputs(lengths, 4, 2, 32, 32, torch.float32, seed=2)
    cu = _cu(lengths)
    with torch.no_grad():
        out = varlen_attention(q, k, v, cu, max(lengths), window=window, sinks=sinks, backend="triton")
    check_close("out", out, _dense(q, k, v, cu, window, sinks, 32 ** -0.5))


def test_triton_window_over_many_tiles(check_close):
    q, k, v, _ = _inputs([150, 7, 97], 2, 1, 16, 16, torch.float32, seed=3)
    cu = _cu([150, 7, 97])
    for window in (1, 20, 33, 64):
        with torch.no_grad():
            out = varlen_attention(q, k, v, cu, 150, window=window, backend="triton")
        check_close(f"window {window}", out, _dense(q, k, v, cu, window, None, 16 ** -0.5))


def test_window_and_sinks_are_checked():
    q, k, v, sinks = _inputs([4, 3], 4, 2, 16, 16, torch.float32)
    cu = _cu([4, 3])
    with pytest.raises(ValueError, match="causal attention only"):
        varlen_attention(q, k, v, cu, 4, causal=False, window=2)
    with pytest.raises(ValueError, match="positive int"):
        varlen_attention(q, k, v, cu, 4, window=0)
    with pytest.raises(ValueError, match=r"sinks must be a float tensor of shape \(4,\)"):
        varlen_attention(q, k, v, cu, 4, sinks=sinks[:2])
    with pytest.raises(ValueError, match="head_dim"):
        varlen_attention(q, k[..., :8], v, cu, 4)  # only v may differ
