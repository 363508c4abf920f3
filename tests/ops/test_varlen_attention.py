"""varlen_attention: the Triton kernels against the per-sample reference, and the reference
against an independent dense-mask computation over the whole pack."""
import pytest
import torch

from dflash.ops import varlen_attention

from .conftest import DEVICE
from .helpers import cu_seqlens, run_varlen, varlen_inputs


def _dense(q, k, v, cu, causal, window=None, sinks=None):
    """Softmax attention over the whole pack with an explicit tokens x tokens mask (float64); a window:
    row i sees keys j > i - window; sinks: one more softmax column per head, value zero."""
    t, hq, d = q.shape
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1, device=q.device), (cu[1:] - cu[:-1]).long())
    mask = seg[:, None] == seg[None, :]
    if causal:
        mask &= torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if window is not None:
        pos = torch.arange(t, device=q.device)
        mask &= pos[:, None] - pos[None, :] < window
    g = hq // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (torch.einsum("ihd,jhd->hij", q, k) * d ** -0.5).masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v)
    p = torch.softmax(torch.cat([s, sinks.view(-1, 1, 1).expand(-1, t, 1)], -1), -1)[..., :-1]
    return torch.einsum("hij,jhd->ihd", p, v)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("lengths", [[5, 1, 12, 0, 7], [1], [9, 9]], ids=["mixed", "one-token", "equal"])
def test_reference_matches_dense_mask(lengths, causal):
    q, k, v, do = varlen_inputs(lengths, 4, 2, 16, torch.float64)
    cu = cu_seqlens(lengths)
    out, grads = run_varlen(q, k, v, do, cu, max(lengths), causal, "torch")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _dense(*leaves, cu, causal)
    ref_grads = torch.autograd.grad(ref, leaves, do)
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("window,sinks", [(4, False), (4, True), (None, True)], ids=["window", "window-sinks",
                                                                                 "sinks"])
def test_reference_tiles_of_rows_match_dense_mask(monkeypatch, window, sinks):
    """The explicit reference (a window, attention sinks) a few query rows at a time: tiles cut inside
    a sample and across the window, values and gradients as one dense mask gives."""
    from dflash.ops.varlen import naive

    monkeypatch.setattr(naive, "ROW_TILE", 3)
    lengths = [11, 1, 7]
    q, k, v, do = varlen_inputs(lengths, 4, 2, 16, torch.float64)
    cu, sink = cu_seqlens(lengths), (torch.randn(4, dtype=torch.float64) if sinks else None)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = varlen_attention(*leaves, cu, 11, causal=True, window=window, sinks=sink, backend="torch")
    grads = torch.autograd.grad(out, leaves, do)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _dense(*leaves, cu, True, window, sink)
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, torch.autograd.grad(ref, leaves, do), strict=True):
        torch.testing.assert_close(got, want)


CASES = [
    pytest.param([37, 1, 64, 5, 0, 20], 4, 2, 64, torch.float32, True, id="fp32-d64-gqa2-causal"),
    pytest.param([37, 1, 64, 5, 0, 20], 4, 2, 64, torch.float32, False, id="fp32-d64-gqa2-full"),
    pytest.param([50, 3, 31], 2, 2, 128, torch.bfloat16, True, id="bf16-d128-mha-causal"),
    pytest.param([33, 1, 70], 4, 1, 64, torch.float16, True, id="fp16-d64-mqa-causal"),
    pytest.param([70, 2], 2, 1, 32, torch.bfloat16, False, id="bf16-d32-full"),
    pytest.param([1, 1, 1], 2, 1, 64, torch.float32, True, id="all-one-token"),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("lengths,hq,hkv,d,dtype,causal", CASES)
def test_triton_matches_reference(lengths, hq, hkv, d, dtype, causal, deterministic, check_close):
    q, k, v, do = varlen_inputs(lengths, hq, hkv, d, dtype)
    cu = cu_seqlens(lengths)
    out, grads = run_varlen(q, k, v, do, cu, max(lengths), causal, "triton", deterministic=deterministic)
    ref, ref_grads = run_varlen(q, k, v, do, cu, max(lengths), causal, "torch", torch.float64)
    low, low_grads = run_varlen(q, k, v, do, cu, max(lengths), causal, "torch")
    check_close("out", out, ref, low)
    for name, got, want, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads, strict=True):
        check_close(name, got, want, lo)


@pytest.mark.parametrize("seed", [1, 2])
def test_triton_matches_reference_random_batches(seed, check_close):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 48, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
    lengths[0] = max(lengths[0], 1)
    causal = bool(seed % 2)
    q, k, v, do = varlen_inputs(lengths, 4, 2, 32, torch.float32, seed)
    cu = cu_seqlens(lengths)
    out, grads = run_varlen(q, k, v, do, cu, max(lengths), causal, "triton")
    ref, ref_grads = run_varlen(q, k, v, do, cu, max(lengths), causal, "torch")
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
        check_close(name, got, want)


def test_cpu_copy_of_cu_seqlens_gives_the_same_result(check_close):
    lengths = [20, 3, 41]
    q, k, v, _ = varlen_inputs(lengths, 2, 1, 32, torch.float32)
    cu = cu_seqlens(lengths)
    exact = varlen_attention(q, k, v, cu, 41, backend="triton", cu_seqlens_cpu=cu.cpu())
    bounded = varlen_attention(q, k, v, cu, 41, backend="triton")
    check_close("out", exact, bounded)


def test_new_lengths_do_not_recompile(count_specializations):
    from dflash.ops.varlen import triton_kernels as tk

    compiled = count_specializations([tk._fwd_kernel, tk._bwd_dkdv_kernel, tk._bwd_dq_kernel])
    first = None
    for lengths in ([20, 7], [3, 1, 40, 16, 9], [64], [5] * 9):
        q, k, v, do = varlen_inputs(lengths, 2, 1, 16, torch.float32)
        run_varlen(q, k, v, do, cu_seqlens(lengths), max(lengths), True, "triton")
        first = compiled() if first is None else first
        assert compiled() == first, f"recompiled for lengths {lengths}"
    assert first <= 3


def test_auto_backend_and_errors():
    q, k, v, _ = varlen_inputs([4, 3], 4, 2, 16, torch.float32)
    cu = cu_seqlens([4, 3])
    if DEVICE == "cpu":  # auto is the reference off CUDA: exactly the same numbers
        assert torch.equal(varlen_attention(q, k, v, cu, 4), varlen_attention(q, k, v, cu, 4, backend="torch"))
    with pytest.raises(ValueError, match="multiple"):
        varlen_attention(q[:, :3], k, v, cu, 4)
    with pytest.raises(TypeError, match="int32"):
        varlen_attention(q, k, v, cu.long(), 4)
    with pytest.raises(ValueError, match="backend"):
        varlen_attention(q, k, v, cu, 4, backend="cuda")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
def test_full_attention_backward_masks_keys_past_the_end_in_float16(deterministic, check_close):
    """Strongly negative logits (row lse about -30 in base 2): a key past the sample's end
    loads as zero but its p = exp2(-lse) must still be masked, or ds overflows float16 and dQ
    turns NaN (in either dQ path). The lengths are not multiples of the key tile."""
    lengths = [20, 7]
    g = torch.Generator().manual_seed(5)
    t, d = sum(lengths), 32
    q = (4 + 0.1 * torch.randn(t, 2, d, generator=g)).to(DEVICE, torch.float16)
    k = (-1.2 + torch.randn(t, 1, d, generator=g)).to(DEVICE, torch.float16)
    v, do = (torch.randn(t, h, d, generator=g).to(DEVICE, torch.float16) for h in (1, 2))
    cu = cu_seqlens(lengths)
    out, grads = run_varlen(q, k, v, do, cu, 20, False, "triton", deterministic=deterministic)
    ref, ref_grads = run_varlen(q, k, v, do, cu, 20, False, "torch", torch.float64)
    low, low_grads = run_varlen(q, k, v, do, cu, 20, False, "torch")
    check_close("out", out, ref, low)
    for name, got, want, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads, strict=True):
        check_close(name, got, want, lo)


def test_max_seqlen_below_the_longest_sample(check_close):
    """Without a host copy of cu_seqlens the kernels must not trust max_seqlen (too small a value
    dropped tiles); with one, a wrong max_seqlen is refused."""
    lengths = [40, 3, 70]
    q, k, v, do = varlen_inputs(lengths, 2, 1, 16, torch.float32)
    cu = cu_seqlens(lengths)
    out, grads = run_varlen(q, k, v, do, cu, 8, True, "triton")
    ref, ref_grads = run_varlen(q, k, v, do, cu, 70, True, "torch")
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
        check_close(name, got, want)
    with pytest.raises(ValueError, match="max_seqlen is 8 but sample 2 has 70 rows"):
        varlen_attention(q, k, v, cu, 8, backend="triton", cu_seqlens_cpu=cu.cpu())


@pytest.mark.parametrize("backend", ["flex", "torch_varlen", "flash_attn"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_library_backends_match_the_float64_reference(backend, causal, check_close):
    """The public kernels behind backend= against the float64 reference: forward everywhere they
    run (FlexAttention runs forward-only on the CPU), backward on CUDA."""
    if backend != "flex" and DEVICE != "cuda":
        with pytest.raises(RuntimeError, match="runs on CUDA tensors"):
            varlen_attention(*varlen_inputs([4], 2, 1, 16, torch.float32)[:3], cu_seqlens([4]), 4, backend=backend)
        return
    if backend == "flash_attn":
        pytest.importorskip("flash_attn")
    lengths = [37, 1, 64, 5, 0, 20]
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    q, k, v, do = varlen_inputs(lengths, 4, 2, 64, dtype)
    cu = cu_seqlens(lengths)
    ref, ref_grads = run_varlen(q, k, v, do, cu, 64, causal, "torch", torch.float64)
    low, low_grads = run_varlen(q, k, v, do, cu, 64, causal, "torch")
    if DEVICE != "cuda":
        out = varlen_attention(q.detach(), k.detach(), v.detach(), cu, 64, causal=causal, backend=backend)
        check_close("out", out, ref, low)
        return
    out, grads = run_varlen(q, k, v, do, cu, 64, causal, backend)
    check_close("out", out, ref, low)
    for name, got, want, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads, strict=True):
        check_close(name, got, want, lo)


def test_auto_falls_back_to_flex_where_no_triton_config_fits(monkeypatch, check_close):
    """On a GPU where no config of a needed kernel fits (triton_kernels.unservable says why), "auto"
    warns and runs FlexAttention instead of failing at the launch; otherwise it runs Triton.
    (Off CUDA "auto" means the reference, so the GPU's answers are simulated here.)"""
    from dflash.ops.common import compile_check
    from dflash.ops.varlen import interface
    from dflash.ops.varlen import triton_kernels as tk

    monkeypatch.setattr(interface, "resolve_backend", lambda name, device: "triton" if name == "auto" else name)
    monkeypatch.setattr(compile_check, "current_capability", lambda: 120)
    asked, launched = [], []
    monkeypatch.setattr(tk, "unservable", lambda *case: asked.append(case) or ("_fwd_kernel: no config fits sm_120a"
                                                                                if case[0] == 64 else None))
    monkeypatch.setattr(tk, "varlen_attention_triton", lambda *args: launched.append(args) or args[0])
    lengths = [9, 4]
    for d in (32, 64):
        q, k, v, _ = varlen_inputs(lengths, 2, 1, d, torch.float32, seed=d)
        if d == 32:
            assert varlen_attention(q, k, v, cu_seqlens(lengths), 9, deterministic=True) is q and len(launched) == 1
            continue
        with pytest.warns(UserWarning, match='no config fits sm_120a.*backend="auto" uses FlexAttention'):
            out = varlen_attention(q, k, v, cu_seqlens(lengths), 9)
        check_close("out", out, varlen_attention(q, k, v, cu_seqlens(lengths), 9, backend="torch"))
    assert len(launched) == 1
    assert asked == [(32, 2, 1, torch.float32, True, True, 120), (64, 2, 1, torch.float32, True, False, 120)]


def test_autotune_is_keyed_by_size_class():
    """The first (possibly tiny) batch must not fix the configs for every size: the autotune key
    holds a power-of-two size class, few enough classes to tune each once."""
    from dflash.ops.common.triton_utils import size_bucket
    from dflash.ops.dflash_block import triton_kernels as bk
    from dflash.ops.varlen import triton_kernels as vk

    assert [size_bucket(n) for n in (0, 1, 4096, 4097, 49152, 65536, 65537, 10**7)] == [
        4096, 4096, 4096, 8192, 65536, 65536, 131072, 1 << 20]
    for tuner in (vk._fwd_kernel, vk._bwd_dkdv_kernel, vk._bwd_dq_kernel, bk._fwd_kernel, bk._bwd_ctx_kernel,
                  bk._bwd_dq_ctx_kernel, bk._bwd_own_kernel):
        assert "n_bucket" in tuner.keys


def _fake_varlen_attn(with_gqa):
    """torch.nn.attention.varlen.varlen_attn as torch 2.11 (no enable_gqa: K/V must have the query's
    heads) or a newer torch declares it, computed by the reference (it has no CPU kernel)."""
    from dflash.ops.varlen.naive import varlen_attention_naive

    def check(q, k, enable_gqa=False):
        assert k.shape[1] == q.shape[1] or enable_gqa, "GQA without enable_gqa"

    if with_gqa:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False):
            check(query, key, enable_gqa)
            return varlen_attention_naive(query, key, value, cu_seq_q, causal=window_size == (-1, 0),
                                          softmax_scale=scale)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1)):
            check(query, key)
            return varlen_attention_naive(query, key, value, cu_seq_q, causal=window_size == (-1, 0),
                                          softmax_scale=scale)
    return varlen_attn


@pytest.mark.parametrize("with_gqa", [False, True], ids=["torch-2.11", "torch-2.13"])
def test_torch_varlen_backend_serves_gqa_with_or_without_enable_gqa(monkeypatch, with_gqa, check_close):
    """torch 2.11's varlen_attn has no enable_gqa (TypeError before): K/V heads are repeated there."""
    import torch.nn.attention.varlen as torch_varlen

    from dflash.ops.varlen.libraries import varlen_attention_library

    monkeypatch.setattr(torch_varlen, "varlen_attn", _fake_varlen_attn(with_gqa))
    lengths = [9, 1, 14]
    q, k, v, do = varlen_inputs(lengths, 4, 2, 16, torch.float32)
    results = []
    for backend in ("torch_varlen", "torch"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        if backend == "torch":
            out = varlen_attention(*leaves, cu_seqlens(lengths), 14, backend="torch", softmax_scale=0.25)
        else:
            out = varlen_attention_library(backend, *leaves, cu_seqlens(lengths), 14, True, 0.25)
        results.append((out, *torch.autograd.grad(out, leaves, do)))
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        check_close(name, got, want)
