"""dflash_block_attention: the Triton kernels against the per-sample reference, and the
reference against an independent dense-mask computation over the whole pack."""
import pytest
import torch

from dflash.ops import dflash_block_attention

from .conftest import DEVICE
from .helpers import block_batch, run_block


def _dense(q, k_ctx, v_ctx, k_blk, v_blk, cu, seq, anchor, block_size, window=None, causal=False):
    """Attention over all context rows and all block rows of the pack with an explicit mask,
    built from the rule of docs/ARCHITECTURE.md ("Drafter layer types as the engines serve them"):
    a query at position p (slot k of a block anchored at a: p = a+k) sees its sample's context
    rows before a and its own block's slots, then, by key position kp (context row j: j; slot i:
    a+i), only kp <= p if causal, and only p - kp < window (and kp - p < window unless causal)."""
    rows, hq, d = q.shape
    t = k_ctx.shape[0]
    ctx_seq = torch.repeat_interleave(torch.arange(len(cu) - 1, device=q.device), (cu[1:] - cu[:-1]).long())
    ctx_pos = torch.arange(t, device=q.device) - cu.long()[ctx_seq]
    q_block = torch.arange(rows, device=q.device) // block_size
    q_seq, q_anchor = seq.long()[q_block], anchor.long()[q_block]
    q_pos = q_anchor + torch.arange(rows, device=q.device) % block_size
    ctx_mask = (ctx_seq[None, :] == q_seq[:, None]) & (ctx_pos[None, :] < q_anchor[:, None])
    blk_mask = q_block[:, None] == q_block[None, :]
    mask = torch.cat([ctx_mask, blk_mask], 1)
    key_pos = torch.cat([ctx_pos, q_pos])[None, :]  # a block row's key position is its query position
    if causal:
        mask &= key_pos <= q_pos[:, None]
    if window is not None:
        mask &= q_pos[:, None] - key_pos < window
        if not causal:
            mask &= key_pos - q_pos[:, None] < window
    g = hq // k_ctx.shape[1]
    k = torch.cat([k_ctx, k_blk]).repeat_interleave(g, 1)
    v = torch.cat([v_ctx, v_blk]).repeat_interleave(g, 1)
    p = torch.softmax((torch.einsum("ihd,jhd->hij", q, k) * d ** -0.5).masked_fill(~mask, float("-inf")), -1)
    return torch.einsum("hij,jhd->ihd", p, v)


# (window, causal): full attention, a sliding layer's rule (window larger and smaller than the
# block), and the variants an `is_causal` override gives.
VARIANTS = [
    pytest.param(None, False, id="full"),
    pytest.param(5, True, id="sliding5-causal"),
    pytest.param(3, True, id="sliding3-causal-window-lt-block"),
    pytest.param(None, True, id="full-causal"),
    pytest.param(3, False, id="sliding3-bidirectional"),
]


@pytest.mark.parametrize("window,causal", VARIANTS)
@pytest.mark.parametrize("lengths,per_seq,block_size", [
    pytest.param([9, 1, 14], 3, 4, id="mixed"),
    pytest.param([0, 6], 2, 3, id="empty-sample"),
])
def test_reference_matches_dense_mask(lengths, per_seq, block_size, window, causal):
    inputs, do, cu, seq, anchor = block_batch(lengths, per_seq, block_size, 4, 2, 16, torch.float64)
    if lengths[0] == 0:
        seq[:] = 1  # no blocks in the empty sample
    out, grads = run_block(inputs, do, cu, seq, anchor, block_size, "torch", window=window, causal=causal)
    leaves = [x.clone().requires_grad_() for x in inputs]
    ref = _dense(*leaves, cu, seq, anchor, block_size, window, causal)
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, torch.autograd.grad(ref, leaves, do), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("window,causal,expected", [
    (None, False, ["xxx...xx..", "xxx...xx..", "........xx", "........xx"]),
    (3, True, [".xx...x...", "..x...xx..", "........x.", "........xx"]),
])
def test_reference_visibility_is_the_documented_example(window, causal, expected):
    """The interface docstring's picture (sample of 6 tokens, B = 2, anchors 3 and 0), read off
    the reference: row r sees key c iff the output row's gradient w.r.t. that value is non-zero."""
    inputs, _, cu, seq, anchor = block_batch([6], 0, 2, 1, 1, 4, torch.float64, anchors=[(0, 3), (0, 0)])
    seen = []
    for r in range(4):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = dflash_block_attention(*leaves, cu, seq, anchor, 2, backend="torch", window=window, causal=causal)
        g_ctx, g_blk = torch.autograd.grad(out[r].sum(), [leaves[2], leaves[4]])  # d out / d v = p
        keys = torch.cat([g_ctx, g_blk]).abs().sum((1, 2)) > 0
        seen.append("".join("x" if v else "." for v in keys.tolist()))
    assert seen == expected


EDGES = [(0, 0), (0, 1), (1, 0), (1, 40), (1, 37), (1, 16), (2, 1), (1, 3), (1, 5), (1, 35)]
# Groups of 16 rows in the interpreter: the forward keeps its output in one accumulator at head dim 16,
# two at 32, and a batched one of 4 / 8 chunks at 64 / 128 (as at head dim 256 in 32-row groups on a GPU).
CASES = [
    pytest.param([40, 1, 23], 5, 4, 4, 2, 64, torch.float32, None, id="fp32-d64-gqa2"),
    pytest.param([40, 1, 23], 5, 4, 4, 2, 64, torch.bfloat16, None, id="bf16-d64-gqa2"),
    pytest.param([29, 3], 4, 4, 2, 1, 128, torch.float16, None, id="fp16-d128-mqa"),
    pytest.param([50, 6], 3, 6, 2, 2, 32, torch.float32, None, id="fp32-d32-block6"),
    pytest.param([1, 40, 2], 0, 4, 2, 1, 32, torch.float32, EDGES, id="anchor0-empty-ctx-full-ctx"),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("lengths,per_seq,block_size,hq,hkv,d,dtype,anchors", CASES)
def test_triton_matches_reference(lengths, per_seq, block_size, hq, hkv, d, dtype, anchors, deterministic,
                                  check_close):
    inputs, do, cu, seq, anchor = block_batch(lengths, per_seq, block_size, hq, hkv, d, dtype, anchors=anchors)
    out, grads = run_block(inputs, do, cu, seq, anchor, block_size, "triton", deterministic=deterministic)
    ref, ref_grads = run_block(inputs, do, cu, seq, anchor, block_size, "torch", torch.float64)
    low, low_grads = run_block(inputs, do, cu, seq, anchor, block_size, "torch")
    check_close("out", out, ref, low)
    for name, got, want, lo in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), grads, ref_grads, low_grads,
                                   strict=True):
        check_close(name, got, want, lo)


# The sliding-layer rule (and the overrides) in the kernels: windows shorter than a context tile
# (16 rows in the interpreter), spanning several, shorter than the block; anchors at 0, at the end.
SLIDING_CASES = [
    pytest.param([40, 1, 23], 5, 4, 4, 2, 64, torch.float32, None, 6, True, id="fp32-d64-gqa2-w6"),
    pytest.param([50, 37], 4, 4, 4, 2, 32, torch.bfloat16, None, 21, True, id="bf16-d32-w21"),
    pytest.param([50, 6], 3, 6, 2, 2, 32, torch.float32, None, 3, True, id="fp32-block6-w3"),
    pytest.param([1, 40, 2], 0, 4, 2, 1, 32, torch.float32, EDGES, 5, True, id="edges-w5"),
    pytest.param([45, 9], 3, 4, 2, 1, 32, torch.float32, None, 7, False, id="bidirectional-w7"),
    # DFlash2's layers (sliding, not causal) in bf16; head dim 16: one forward accumulator (16-row groups)
    pytest.param([50, 37], 4, 4, 4, 2, 32, torch.bfloat16, None, 21, False, id="bf16-d32-w21-bidirectional"),
    pytest.param([45, 9], 3, 4, 2, 1, 16, torch.float32, None, 7, False, id="d16-bidirectional-w7"),
    pytest.param([45, 9], 3, 4, 2, 1, 32, torch.float32, None, None, True, id="full-causal"),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("lengths,per_seq,block_size,hq,hkv,d,dtype,anchors,window,causal", SLIDING_CASES)
def test_triton_sliding_variants_match_reference(lengths, per_seq, block_size, hq, hkv, d, dtype, anchors, window,
                                                 causal, deterministic, check_close):
    inputs, do, cu, seq, anchor = block_batch(lengths, per_seq, block_size, hq, hkv, d, dtype, anchors=anchors)
    variant = dict(window=window, causal=causal)
    out, grads = run_block(inputs, do, cu, seq, anchor, block_size, "triton", deterministic=deterministic, **variant)
    ref, ref_grads = run_block(inputs, do, cu, seq, anchor, block_size, "torch", torch.float64, **variant)
    low, low_grads = run_block(inputs, do, cu, seq, anchor, block_size, "torch", **variant)
    check_close("out", out, ref, low)
    for name, got, want, lo in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), grads, ref_grads, low_grads,
                                   strict=True):
        check_close(name, got, want, lo)


@pytest.mark.parametrize("seed", [3, 4])
def test_triton_matches_reference_random_batches(seed, check_close):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
    per_seq = int(torch.randint(1, 7, (1,), generator=g))
    inputs, do, cu, seq, anchor = block_batch(lengths, per_seq, 4, 4, 2, 32, torch.float32, seed)
    leaves = [x.clone().requires_grad_() for x in inputs]
    # One seed passes the CPU copy of cu_seqlens (exact tile count), the other does not.
    cu_cpu = cu.cpu() if seed % 2 else None
    out = dflash_block_attention(*leaves, cu, seq, anchor, 4, backend="triton", cu_seqlens_cpu=cu_cpu)
    grads = torch.autograd.grad(out, leaves, do)
    ref, ref_grads = run_block(inputs, do, cu, seq, anchor, 4, "torch")
    for name, got, want in zip(("out", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), (out, *grads), (ref, *ref_grads),
                                   strict=True):
        check_close(name, got, want)


def test_new_batches_do_not_recompile(count_specializations):
    from dflash.ops.dflash_block import triton_kernels as tk

    compiled = count_specializations([tk._fwd_kernel, tk._bwd_ctx_kernel, tk._bwd_own_kernel])
    first = None
    for i, (lengths, per_seq) in enumerate((([30, 9], 3), ([5, 1, 60, 17], 2), ([64], 7), ([8] * 5, 1))):
        inputs, do, cu, seq, anchor = block_batch(lengths, per_seq, 4, 2, 1, 16, torch.float32, seed=i)
        run_block(inputs, do, cu, seq, anchor, 4, "triton")
        first = compiled() if first is None else first
        assert compiled() == first, f"recompiled for lengths {lengths}, {per_seq} blocks per sample"
    assert first <= 3


def test_deterministic_follows_torch_and_repeats_bitwise(monkeypatch):
    """deterministic=None follows torch.use_deterministic_algorithms; the deterministic backward
    runs the dQ kernel of its own (no atomics) and repeats bitwise (meaningful on CUDA, where
    atomics land in any order)."""
    from dflash.ops.dflash_block import triton_kernels as tk

    launches = []
    launch = tk.launch

    def spy(tuner, *args, **kwargs):
        if tuner is tk._bwd_dq_ctx_kernel:
            launches.append(args[0])
        return launch(tuner, *args, **kwargs)

    monkeypatch.setattr(tk, "launch", spy)
    inputs, do, cu, seq, anchor = block_batch([37, 5], 3, 4, 4, 2, 32, torch.float32)
    run_block(inputs, do, cu, seq, anchor, 4, "triton")
    assert not launches
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    first = run_block(inputs, do, cu, seq, anchor, 4, "triton")[1]
    assert len(launches) == 1
    again = run_block(inputs, do, cu, seq, anchor, 4, "triton")[1]
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


def test_errors_name_the_problem():
    inputs, _, cu, seq, anchor = block_batch([6, 4], 2, 4, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="num_blocks"):
        dflash_block_attention(*inputs, cu, seq, anchor, 3)
    with pytest.raises(TypeError, match="int32"):
        dflash_block_attention(*inputs, cu, seq.long(), anchor, 4)
    with pytest.raises(ValueError, match="past its length"):
        dflash_block_attention(*inputs, cu, seq, anchor + 7, 4, backend="torch")
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="window must be None or an integer >= 1"):
            dflash_block_attention(*inputs, cu, seq, anchor, 4, window=bad)


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the check is a device-side assert, which ends the process")
@pytest.mark.parametrize("bad", ["anchor", "sample"])
def test_triton_refuses_blocks_outside_their_sample(bad):
    """An anchor past its sample's length made the kernels read the next sample's rows."""
    inputs, _, cu, seq, anchor = block_batch([6, 4], 2, 4, 4, 2, 16, torch.float32)
    if bad == "anchor":
        anchor = torch.where(seq == 0, 7, anchor).to(torch.int32)
    else:
        seq = torch.where(seq == 0, 2, seq).to(torch.int32)
    with pytest.raises(RuntimeError, match="past that sample's length"):
        dflash_block_attention(*inputs, cu, seq, anchor, 4, backend="triton")


@pytest.mark.parametrize("backend,window,causal", [
    pytest.param("flex", None, False, id="flex"),
    pytest.param("torch_varlen", None, False, id="torch_varlen"),
    pytest.param("flex", 6, True, id="flex-sliding6-causal"),
    pytest.param("flex", 3, True, id="flex-sliding3-causal"),
    pytest.param("flex", 5, False, id="flex-sliding5-bidirectional"),
])
def test_flex_backend_matches_the_float64_reference(backend, window, causal, check_close):
    """FlexAttention with the block mask (also what torch_varlen / flash_attn select for this op):
    forward on the CPU (no CPU backward in torch), forward and backward on CUDA."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    inputs, do, cu, seq, anchor = block_batch([40, 1, 23], 5, 4, 4, 2, 64, dtype, anchors=None)
    variant = dict(window=window, causal=causal)
    ref, ref_grads = run_block(inputs, do, cu, seq, anchor, 4, "torch", torch.float64, **variant)
    low, low_grads = run_block(inputs, do, cu, seq, anchor, 4, "torch", **variant)
    if DEVICE != "cuda":
        detached = [x.detach() for x in inputs]  # run_block made the inputs themselves leaves
        out = dflash_block_attention(*detached, cu, seq, anchor, 4, backend=backend, **variant)
        check_close("out", out, ref, low)
        return
    out, grads = run_block(inputs, do, cu, seq, anchor, 4, backend, **variant)
    check_close("out", out, ref, low)
    for name, got, want, lo in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), grads, ref_grads, low_grads,
                                   strict=True):
        check_close(name, got, want, lo)


def test_auto_falls_back_to_flex_where_no_triton_config_fits(monkeypatch, check_close):
    """As for varlen_attention: where triton_kernels.unservable names a kernel no config of which
    fits the GPU, "auto" warns and runs FlexAttention (GPU answers simulated off CUDA)."""
    from dflash.ops.common import compile_check
    from dflash.ops.dflash_block import interface
    from dflash.ops.dflash_block import triton_kernels as tk

    monkeypatch.setattr(interface, "resolve_backend", lambda name, device, op: "triton" if name == "auto" else name)
    monkeypatch.setattr(compile_check, "current_capability", lambda: 120)
    asked = []
    monkeypatch.setattr(tk, "unservable", lambda *case: asked.append(case) or "_bwd_own_kernel: no config fits sm_120a")
    inputs, do, cu, seq, anchor = block_batch([23, 9], 2, 4, 4, 2, 32, torch.float32)
    with pytest.warns(UserWarning, match='no config fits sm_120a.*backend="auto" uses FlexAttention'):
        out = dflash_block_attention(*inputs, cu, seq, anchor, 4)
    check_close("out", out, dflash_block_attention(*inputs, cu, seq, anchor, 4, backend="torch"))
    assert asked == [(32, 4, 2, torch.float32, 4, False, False, False, 120)]


@pytest.mark.parametrize("window,causal", VARIANTS)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 1)])
def test_chunked_reference_matches_the_plain_one(window, causal, hq, hkv):
    """The long-sample path (`chunked.py`): blocks cut into chunks of a few scores each, recomputed in
    backward; values and every gradient equal the plain reference's (float64), blocks in any order,
    overlapping, at anchor 0 and at a sample's end, an empty sample beside."""
    from dflash.ops.dflash_block.chunked import chunk_blocks, dflash_block_attention_chunked

    anchors = [(2, 0), (0, 37), (2, 30), (0, 5), (2, 17), (0, 37), (0, 0), (2, 29), (0, 12), (2, 3)]
    inputs, do, cu, seq, anchor = block_batch([40, 0, 30], 0, 4, hq, hkv, 8, torch.float64, anchors=anchors)
    variant = dict(window=window, causal=causal)
    budget = 4 * hq * 24  # a block and 20 context rows
    chunks = chunk_blocks(cu.tolist(), seq, anchor, 4, hq, window, budget)
    assert 4 < len(chunks) < len(anchors) and sorted(sum((c[0].tolist() for c in chunks), [])) == list(range(10))
    ref, ref_grads = run_block(inputs, do, cu, seq, anchor, 4, "torch", **variant)
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = dflash_block_attention_chunked(*leaves, cu, seq, anchor, 4, budget=budget, **variant)
    torch.testing.assert_close(out, ref)
    for got, want in zip(torch.autograd.grad(out, leaves, do), ref_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_the_reference_runs_chunked_past_its_score_limit_in_a_chunks_memory(monkeypatch):
    """Above REFERENCE_SCORES the torch backend runs chunked: the same values and gradients, and the
    step's peak tensor bytes stay near one chunk's instead of every score kept for backward."""
    from dflash.ops.dflash_block import chunked
    from dflash.sizing.tensor_bytes import measure_peak_tensor_bytes

    inputs, do, cu, seq, anchor = block_batch([768], 24, 16, 2, 1, 16, torch.float32)

    def step():
        out, grads = run_block(inputs, do, cu, seq, anchor, 16, "torch", window=64, causal=True)
        return out.detach(), grads

    plain_peak, (plain, plain_grads) = measure_peak_tensor_bytes(step)
    monkeypatch.setattr(chunked, "REFERENCE_SCORES", 0)
    monkeypatch.setattr(chunked, "CHUNK_SCORES", 1 << 14)
    chunked_peak, (out, grads) = measure_peak_tensor_bytes(step)
    torch.testing.assert_close(out, plain)
    for got, want in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want)
    io = sum(x.numel() * x.element_size() for x in (*inputs, do))
    # inputs, output and gradients, and one chunk (~50 bytes a score)
    assert chunked_peak < 3 * io + 50 * (1 << 14) < plain_peak / 4, (chunked_peak, plain_peak, io)


def test_without_gradients_the_reference_runs_chunked_only_past_one_samples_limit(monkeypatch):
    """A forward without gradients keeps no scores: the plain reference's result, bit for bit (a
    held-out walk is unchanged), until one sample's scores pass FORWARD_SCORES."""
    from dflash.ops.dflash_block import chunked
    from dflash.ops.dflash_block.naive import dflash_block_attention_naive

    (q, kc, vc, kb, vb), _, cu, seq, anchor = block_batch([300, 200], 12, 16, 2, 1, 16, torch.float32)
    args = (q, kc, vc, kb, vb, cu, seq, anchor, 16)
    called = []
    monkeypatch.setattr(chunked, "REFERENCE_SCORES", 0)  # counts only with gradients
    monkeypatch.setattr(chunked, "dflash_block_attention_chunked",
                        lambda *a, **k: called.append(1) or dflash_block_attention_naive(*a, **k))
    with torch.no_grad():
        plain = dflash_block_attention(*args, backend="torch", window=64)
        assert torch.equal(plain, dflash_block_attention_naive(*args, window=64)) and not called
        per_sample = 12 * 16 * 300 * 2  # the larger sample's rows x its length x query heads
        monkeypatch.setattr(chunked, "FORWARD_SCORES", per_sample - 1)
        dflash_block_attention(*args, backend="torch", window=64)
        assert called == [1]
        monkeypatch.setattr(chunked, "FORWARD_SCORES", per_sample)
        dflash_block_attention(*args, backend="torch", window=64)
        assert called == [1]
