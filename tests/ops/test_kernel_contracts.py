"""What the kernels promise beyond matching the reference on one call in the interpreter: the first
call after autotuning is right, deterministic mode does not depend on timings, every variant is
tuned on its own, any config the autotuner may choose is right, offsets past int32 are right, and
bad cu_seqlens are refused.

On a GPU the Triton autotuner runs every surviving config of a new tuning key on the live buffers,
many times each (do_bench), before the real launch; the interpreter has one config and never times
it. These tests give the kernels several configs and a stand-in benchmark that calls each config
like do_bench does, which is what a GPU's first call of each size class goes through.
"""
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from dflash.ops import dflash_block_attention, varlen_attention
from dflash.ops.dflash_block import triton_kernels as bk
from dflash.ops.varlen import triton_kernels as vk

from .conftest import DEVICE
from .helpers import block_batch, cu_seqlens, run_block, run_varlen, varlen_inputs

pytestmark = pytest.mark.skipif(DEVICE == "cuda", reason="simulates a GPU's autotuner in the interpreter")

ROOT = Path(__file__).resolve().parents[2]
VARLEN = [vk._fwd_kernel, vk._bwd_dkdv_kernel, vk._bwd_dq_kernel]
BLOCK = [bk._fwd_kernel, bk._bwd_ctx_kernel, bk._bwd_dq_ctx_kernel, bk._bwd_own_kernel]
# The tuned tile of each kernel (interpreter tiles: 32-row varlen tiles, 16-row block groups).
TUNED = {vk._fwd_kernel: "BLOCK_N", vk._bwd_dkdv_kernel: "BLOCK_M", vk._bwd_dq_kernel: "BLOCK_N",
         bk._fwd_kernel: "BLOCK_N", bk._bwd_dq_ctx_kernel: "BLOCK_N"}


def _configs(tuner, sizes=(16, 32)):
    """Several configs that give different bits (different inner steps), or differ in warps."""
    name = TUNED.get(tuner)
    if name is None:
        return [triton.Config({}, num_warps=w, num_stages=1) for w in (4, 8)]
    return [triton.Config({name: n}, num_warps=4, num_stages=1) for n in sizes]


def _simulate_gpu_tuning(monkeypatch, tuners, timings, configs=None):
    """Give `tuners` several configs, an empty tuning cache and a stand-in for do_bench that runs
    each config 3 times on the live buffers and reports timings[i] for the i-th config (the
    early prune is a stand-in too: there is no GPU to compile for). Returns the calls per tuner."""
    calls = {}
    for tuner in tuners:
        tuner_configs = (configs or {}).get(tuner) or _configs(tuner)
        monkeypatch.setattr(tuner, "configs", tuner_configs)
        monkeypatch.setattr(tuner, "cache", {})
        monkeypatch.setattr(tuner, "early_config_prune", lambda configs, nargs, **kwargs: configs)

        def bench(kernel_call, quantiles, _tuner=tuner):
            for _ in range(3):
                kernel_call()
            calls[_tuner] = calls.get(_tuner, 0) + 1
            t = timings[(calls[_tuner] - 1) % len(timings)]
            return [t, t, t]

        monkeypatch.setattr(tuner, "_do_bench", bench)
        monkeypatch.setitem(tuner.__dict__, "do_bench", bench)  # a cached_property: the first bench sticks
    return calls


def test_first_varlen_call_after_autotuning_matches_the_reference(monkeypatch, check_close):
    """dQ is added into DQ_ACC with atomics: without reset_to_zero the first call's dQ held every
    benchmark run's adds too (relative error about 7 with two configs timed 3 times each)."""
    calls = _simulate_gpu_tuning(monkeypatch, VARLEN, [2.0, 1.0])
    lengths = [40, 1, 20]
    q, k, v, do = varlen_inputs(lengths, 2, 1, 32, torch.float32)
    cu = cu_seqlens(lengths)
    out, grads = run_varlen(q, k, v, do, cu, 40, True, "triton", deterministic=False)
    assert calls[vk._bwd_dkdv_kernel] == 2  # the first call did tune
    ref, ref_grads = run_varlen(q, k, v, do, cu, 40, True, "torch", torch.float64)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
        check_close(name, got, want)


@pytest.mark.parametrize("window,causal", [(None, False), (6, True), (6, False)],
                         ids=["full", "sliding-causal", "sliding-bidirectional"])
def test_first_block_call_after_autotuning_matches_the_reference(monkeypatch, check_close, window, causal):
    """As for varlen: the block dK/dV kernel adds the context's dQ into DQ_ACC (error 4.6 before);
    also for a drafter's sliding layers (DFlash2's: sliding, not causal), each variant tuned anew."""
    calls = _simulate_gpu_tuning(monkeypatch, BLOCK, [2.0, 1.0])
    inputs, do, cu, seq, anchor = block_batch([40, 1, 23], 3, 4, 2, 1, 32, torch.float32)
    out, grads = run_block(inputs, do, cu, seq, anchor, 4, "triton", deterministic=False, window=window,
                            causal=causal)
    assert calls[bk._bwd_ctx_kernel] == 2 and calls[bk._fwd_kernel] == 2
    ref, ref_grads = run_block(inputs, do, cu, seq, anchor, 4, "torch", torch.float64, window=window, causal=causal)
    for name, got, want in zip(("out", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), (out, *grads),
                               (ref, *ref_grads), strict=True):
        check_close(name, got, want)


@pytest.mark.parametrize("op", ["varlen", "block"])
def test_deterministic_mode_runs_one_config_whatever_the_timings(monkeypatch, op):
    """Two processes whose benchmarks favour different configs must give the same bits in
    deterministic mode: it runs the fastest expected config (the larger inner step here) and
    never times anything."""
    results = []
    for timings in ([1.0, 2.0], [2.0, 1.0]):  # two "processes": the first or the second config is faster
        calls = _simulate_gpu_tuning(monkeypatch, VARLEN if op == "varlen" else BLOCK, timings)
        if op == "varlen":
            lengths = [40, 1, 20]
            q, k, v, do = varlen_inputs(lengths, 2, 1, 32, torch.float32)
            out, grads = run_varlen(q, k, v, do, cu_seqlens(lengths), 40, True, "triton", deterministic=True)
        else:
            inputs, do, cu, seq, anchor = block_batch([40, 1, 23], 3, 4, 2, 1, 32, torch.float32)
            out, grads = run_block(inputs, do, cu, seq, anchor, 4, "triton", deterministic=True)
        assert not calls, f"deterministic mode timed configs: {calls}"
        results.append((out, *grads))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_pinned_config_is_the_fastest_expected():
    """Most work per step first (the larger tuned tile), then more stages, then more warps."""
    from dflash.ops.common.compile_check import expected_speed

    configs = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n in (32, 64) for w in (4, 8)
               for s in (1, 2, 3)]
    best = sorted(configs, key=expected_speed, reverse=True)
    assert [(c.kwargs["BLOCK_N"], c.num_stages, c.num_warps) for c in best[:3]] == [(64, 3, 8), (64, 3, 4),
                                                                                    (64, 2, 8)]


# Constexprs a tuning key need not hold: the tuned tiles, and tiles fixed by head_dim, dtype and B
# (in the key) on a given GPU.
_DERIVED = {"BLOCK_M", "BLOCK_N", "BPG", "OWN_M", "PER_PART", "BLOCK", "CHUNKS"}


@pytest.mark.parametrize("tuner", VARLEN + BLOCK,
                         ids=lambda t: f"{'varlen' if t in VARLEN else 'block'}{t.base_fn.__name__}")
def test_tuning_keys_tell_every_variant_apart(tuner):
    """Variant flags (CAUSAL, FUSED_DQ, OFFS64) must be in the key: else whichever variant runs first
    picks the config of the others (which may spill or not fit)."""
    params = inspect.signature(tuner.base_fn).parameters.values()
    constexprs = {p.name for p in params if "constexpr" in str(p.annotation)}
    assert constexprs - _DERIVED <= set(tuner.keys), (tuner.base_fn.__name__, tuner.keys)


def test_every_config_the_autotuner_may_choose_is_right(monkeypatch, check_close):
    """A causal dK/dV query step larger than the key tile (64 > 32 here; 64 > 32 for fp32 at head dim
    128 on a GPU) counted the rows past the key tile twice."""
    lengths = [70, 9, 33]
    q, k, v, do = varlen_inputs(lengths, 2, 1, 32, torch.float32)
    cu = cu_seqlens(lengths)
    ref, ref_grads = run_varlen(q, k, v, do, cu, 70, True, "torch", torch.float64)
    for step in (16, 32, 64):
        monkeypatch.setattr(vk._bwd_dkdv_kernel, "configs", [triton.Config({"BLOCK_M": step}, num_warps=4)])
        _, grads = run_varlen(q, k, v, do, cu, 70, True, "triton", deterministic=step == 32)
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
            check_close(f"{name} (query step {step})", got, want)


def test_offsets_switch_to_int64_at_2_to_the_31():
    from dflash.ops.common.triton_utils import offsets_need_int64

    assert offsets_need_int64(512 * 1024, 32, 128)  # one 512K-token sample at 32 heads x 128
    assert not offsets_need_int64(2**31 // (32 * 128) - 513, 32, 128)
    assert offsets_need_int64(2**31 // (32 * 128) - 512, 32, 128)  # rows up to two tiles past the end


@pytest.mark.parametrize("op", ["varlen", "block"])
def test_int64_offsets_give_the_same_results(monkeypatch, op, check_close):
    """The int64 variant (OFFS64) of every kernel, forced on a small batch."""
    for module in (vk, bk):
        monkeypatch.setattr(module, "offsets_need_int64", lambda *args: True)
    if op == "varlen":
        lengths = [40, 1, 20]
        q, k, v, do = varlen_inputs(lengths, 2, 1, 32, torch.float32)
        cu = cu_seqlens(lengths)
        assert vk._offs64(q, None)
        runs = [run_varlen(q, k, v, do, cu, 40, True, b, deterministic=d) for b, d in
                (("triton", False), ("triton", True), ("torch", None))]
        names = ("out", "dq", "dk", "dv")
    else:
        inputs, do, cu, seq, anchor = block_batch([40, 1, 23], 3, 4, 2, 1, 32, torch.float32)
        assert bk._offs64(inputs[0], inputs[1], None)
        runs = [run_block(inputs, do, cu, seq, anchor, 4, b, deterministic=d) for b, d in
                (("triton", False), ("triton", True), ("torch", None))]
        names = ("out", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk")
    ref = (runs[2][0], *runs[2][1])
    for out, grads in runs[:2]:
        for name, got, want in zip(names, (out, *grads), ref, strict=True):
            check_close(name, got, want)


# One sample of 2**24 + 64 rows at 8 query heads x 16 (2**31 + 1024 elements of q): the dK/dV
# kernel for its last key tile only (a few query tiles of work). The tensors are allocated but
# never filled (untouched pages cost no memory), only the last rows are written.
LONG_SAMPLE = r"""
import json, sys
import torch, triton
from dflash.ops.common.triton_utils import LOG2E, offsets_need_int64
from dflash.ops.varlen import triton_kernels as vk

L, HQ, HKV, D, TAIL = 2**24 + 64, 8, 1, 16, 64
offs64 = offsets_need_int64(L, HQ, D)
g = torch.Generator().manual_seed(0)
q, do = (torch.empty(L, HQ, D, dtype=torch.float16) for _ in range(2))
k, v, dk, dv = (torch.empty(L, HKV, D, dtype=torch.float16) for _ in range(4))
lse, delta = (torch.empty(HQ, L) for _ in range(2))
for x in (q, do, k, v):
    x[-TAIL:] = torch.randn(TAIL, *x.shape[1:], generator=g).half()
lse[:, -TAIL:] = 3 + torch.rand(HQ, TAIL, generator=g)
delta[:, -TAIL:] = torch.randn(HQ, TAIL, generator=g)
block = vk.DKV_BLOCK_N
tiles = torch.tensor([[0, L // block - 1]], dtype=torch.int32)  # the last key tile
cu = torch.tensor([0, L], dtype=torch.int32)
scale = D ** -0.5
flags = [True, False] if sys.argv[1] == "both" else [offs64]
for flag in flags:  # int32 last: it may crash
    vk._bwd_dkdv_kernel[(HKV,)](q, k, v, do, lse, delta, dk, dv, torch.zeros(0), cu, tiles, scale * LOG2E, scale,
                                4096, L, HQ=HQ, HKV=HKV, D=D, CAUSAL=True, BLOCK_N=block, FUSED_DQ=False,
                                OFFS64=flag)
    # The FA2 dK/dV of the last key tile from the given lse (base 2) and delta, in float64.
    qt, dot, kt, vt = (x[-block:].double() for x in (q, do, k, v))
    kt, vt = kt.expand(-1, HQ, -1), vt.expand(-1, HQ, -1)
    p = torch.exp2(torch.einsum("ihd,jhd->hij", qt, kt) * scale * LOG2E - lse[:, -block:, None].double())
    p = p * torch.ones(block, block, dtype=torch.bool).tril()
    ds = p * (torch.einsum("ihd,jhd->hij", dot, vt) - delta[:, -block:, None].double())
    want_dk = torch.einsum("hij,ihd->jd", ds, qt) * scale
    want_dv = torch.einsum("hij,ihd->jd", p, dot)
    err = max(((got[-block:, 0].double() - want).abs().max() / want.abs().max()).item()
              for got, want in ((dk, want_dk), (dv, want_dv)))
    print(json.dumps({"offs64": flag, "chosen": offs64, "err": err}), flush=True)
"""


def test_a_sample_past_int32_offsets_reads_its_own_rows():
    """With int32 tile offsets the kernel read rows 2**31 elements before the ones it meant
    (or crashed): the int64 variant is chosen and right. Run in a child: the int32 run may crash."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TRITON_INTERPRET": "1",
                                                                        "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", LONG_SAMPLE, "both"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines and lines[0]["chosen"] and lines[0]["offs64"], (done.stdout, done.stderr[-2000:])
    assert lines[0]["err"] < 1e-2, lines
    # The same kernel with int32 offsets goes wrong here (wrong rows, or a crash): the test sees the overflow.
    assert done.returncode != 0 or lines[1]["err"] > 0.1, lines


def _varlen(cu, t=None, cu_cpu=None, backend="triton"):
    q, k, v, _ = varlen_inputs([t or int(cu[-1])], 2, 1, 16, torch.float32)
    return varlen_attention(q, k, v, torch.tensor(cu, dtype=torch.int32, device=DEVICE), 64, backend=backend,
                            cu_seqlens_cpu=cu_cpu)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cu_seqlens_must_end_at_the_rows_and_never_decrease(backend):
    """Rows past cu_seqlens[-1] were left unwritten (torch.empty) by the kernels."""
    with pytest.raises(ValueError, match="must start at 0 and end at 30 .* got 0 ... 20"):
        _varlen([0, 12, 20], t=30, backend=backend)
    with pytest.raises(ValueError, match="decreases at entry 2: 15 then 9"):
        _varlen([0, 15, 9, 20], backend=backend)
    with pytest.raises(ValueError, match="must start at 0"):
        _varlen([3, 12, 20], backend=backend)
    with pytest.raises(ValueError, match="cu_seqlens_cpu has 2 entries but cu_seqlens has 3"):
        _varlen([0, 12, 20], cu_cpu=torch.tensor([0, 20], dtype=torch.int32), backend=backend)


def test_cu_seqlens_ctx_is_checked_too():
    inputs, _, cu, seq, anchor = block_batch([6, 4], 2, 4, 4, 2, 16, torch.float32)
    k_ctx, v_ctx = (torch.cat([x, x[:3]]) for x in inputs[1:3])  # 3 context rows past cu[-1]
    with pytest.raises(ValueError, match="cu_seqlens_ctx must start at 0 and end at 13"):
        dflash_block_attention(inputs[0], k_ctx, v_ctx, *inputs[3:], cu, seq, anchor, 4, backend="triton")
    bad = torch.tensor([0, 7, 5, 10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens_ctx decreases at entry 2: 7 then 5"):
        dflash_block_attention(*inputs, bad, seq, anchor, 4, backend="triton")
