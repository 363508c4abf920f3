"""The one-shot GPU check's stage for the fused drafter ops (launch/gpu_check.py, stage `fused_ops`):
the block convolution (`dflash.ops.block_conv`) and the frozen head with in-kernel top-K
(`dflash.ops.head_topk`), each against its torch path at Qwen3-8B's sizes (bf16): correctness of the
first call (the one that autotunes) and of a second, then forward and backward times of both.

Writes OUT/fused_ops.json: per op, `checks` (relative RMS errors against the fp32 reference, top-K id
agreement) and `timings` (ms, median of the repeats: ours, the torch path's, their ratio).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from dflash.tools.gpu_check_training import Report


def sizes(dry_run: bool) -> dict:
    """Qwen3-8B: 4,096 blocks of 16 rows at hidden 4,096 (groups 16, kernel 2: as released); a chunk of
    1,024 rows of the 151,936-id head, top-16, softcap 30. Tiny for the dry run."""
    if dry_run:
        return {"rows": 4 * 16, "hidden": 64, "group": 16, "taps": 2, "block": 16, "chunk": 3, "vocab": 200,
                "top_k": 4, "softcap": 30.0, "dtype": torch.float32, "repeats": 1}
    return {"rows": 4096 * 16, "hidden": 4096, "group": 16, "taps": 2, "block": 16, "chunk": 1024, "vocab": 151936,
            "top_k": 16, "softcap": 30.0, "dtype": torch.bfloat16, "repeats": 10}


def _rel_rms(x, ref) -> float:
    ref = ref.detach().double()
    x = x.detach()
    return float((x.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12))


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1e3)
    return sorted(times)[len(times) // 2]


def _conv(s: dict, device: str, report: Report, deadline: float) -> bool:
    from dflash.ops.block_conv import block_conv
    from dflash.ops.block_conv.naive import block_conv_naive

    g = torch.Generator(device=device).manual_seed(0)
    n, h, k, grp = s["rows"], s["hidden"], s["taps"], s["group"]
    x = torch.randn(n, h, device=device, generator=g).to(s["dtype"])
    dyn = (0.1 * torch.randn(n, k, h // grp, device=device, generator=g)).to(s["dtype"])
    base = torch.randn(k, h, device=device, generator=g)
    do = torch.randn(n, h, device=device, generator=g).to(s["dtype"])
    backend = "triton"

    def run(fn, xs, **kw):
        leaves = [t.detach().requires_grad_() for t in xs]
        out = fn(*leaves, s["block"], grp, **kw)
        return [out, *torch.autograd.grad(out, leaves, do.to(out.dtype))]

    check_rows = min(n, 256 * s["block"])  # the fp32 reference on a slice (its graph is large)
    ref = run(block_conv_naive, [t[:check_rows].float() if t is not base else t for t in (x, dyn, base)])
    checks, ok = [], True
    for call in ("first call", "second call"):
        got = run(block_conv, (x, dyn, base), backend=backend)
        got = [got[0][:check_rows], got[1][:check_rows], got[2][:check_rows]]
        errors = {name: _rel_rms(a, b) for name, a, b in zip(("out", "dx", "ddynamic"), got, ref, strict=False)}
        passed = all(e < 2e-2 for e in errors.values())
        ok = ok and passed
        checks.append({"call": call, "errors": errors, "passed": passed})
    timings = {}
    if time.monotonic() < deadline:
        forward = {"ours": lambda: block_conv(x, dyn, base, s["block"], grp, backend=backend),
                   "torch": lambda: block_conv_naive(x, dyn, base, s["block"], grp)}
        both = {"ours": lambda: run(block_conv, (x, dyn, base), backend=backend),
                "torch": lambda: run(block_conv_naive, (x, dyn, base))}
        for name in forward:
            with torch.no_grad():
                timings[f"{name}_fwd_ms"] = _median_ms(forward[name], s["repeats"])
            timings[f"{name}_fwdbwd_ms"] = _median_ms(both[name], s["repeats"])
        timings["fwdbwd_speedup"] = timings["torch_fwdbwd_ms"] / timings["ours_fwdbwd_ms"]
    report.update(block_conv={"checks": checks, "timings": timings, "shape": [n, h], "group": grp, "taps": k})
    return ok


def _head(s: dict, device: str, report: Report, deadline: float) -> bool:
    from dflash.ops.head_topk import head_topk, head_topk_backward_
    from dflash.ops.head_topk.naive import head_topk_backward_naive_, head_topk_naive

    g = torch.Generator(device=device).manual_seed(1)
    rows, vocab, top_k, cap = s["chunk"], s["vocab"], s["top_k"], s["softcap"]
    logits = (8 * torch.randn(rows, vocab, device=device, generator=g)).to(s["dtype"])
    labels = torch.randint(0, vocab, (rows,), device=device, generator=g)
    coef = torch.rand(rows, device=device, generator=g)
    want = head_topk_naive(logits, labels, top_k, 0.7, cap)
    want_grad = head_topk_backward_naive_(logits.to(torch.float32, copy=True), labels, want[0], coef, 0.7, cap)
    checks, ok = [], True
    for call in ("first call", "second call"):
        got = head_topk(logits, labels, top_k, logit_scale=0.7, softcap=cap, backend="triton")
        grad = head_topk_backward_(logits.clone(), labels, got.lse, coef, logit_scale=0.7, softcap=cap,
                                   backend="triton")
        same_ids = float((got.top_ids == want[4]).float().mean())
        errors = {"lse": _rel_rms(got.lse, want[0]), "gold": _rel_rms(got.gold, want[1]),
                  "top_values": _rel_rms(got.top_values, want[3]), "dlogits": _rel_rms(grad, want_grad)}
        argmax_same = float((got.argmax == want[2]).float().mean())
        # equal bf16 logits may order differently (the kernels keep the lower id): ids agree almost everywhere
        passed = all(e < 2e-2 for e in errors.values()) and same_ids > 0.99 and argmax_same > 0.99
        ok = ok and passed
        checks.append({"call": call, "errors": errors, "top_ids_same": same_ids, "argmax_same": argmax_same,
                       "passed": passed})
    timings = {}
    if time.monotonic() < deadline:
        def torch_stats():  # the loss room's pass: an fp32 copy, the map, argmax, gold, top-K, log-sum-exp
            z = logits.float().mul_(0.7 / cap).tanh_().mul_(cap)
            return z.argmax(-1), z.gather(1, labels[:, None]), z.topk(top_k, dim=-1), torch.logsumexp(z, -1)

        buffer = logits.clone()
        timings = {"ours_stats_ms": _median_ms(lambda: head_topk(logits, labels, top_k, logit_scale=0.7, softcap=cap,
                                                                 backend="triton"), s["repeats"]),
                   "torch_stats_ms": _median_ms(torch_stats, s["repeats"]),
                   "torch_topk_alone_ms": _median_ms(lambda: logits.topk(top_k, dim=-1), s["repeats"]),
                   # (after the first run the buffer holds gradients: the same work on other values)
                   "ours_backward_ms": _median_ms(lambda: head_topk_backward_(buffer, labels, want[0], coef,
                                                                              logit_scale=0.7, softcap=cap,
                                                                              backend="triton"), s["repeats"]),
                   "torch_backward_ms": _median_ms(lambda: head_topk_backward_naive_(logits.clone(), labels, want[0],
                                                                                     coef, 0.7, cap), s["repeats"])}
        timings["stats_speedup"] = timings["torch_stats_ms"] / timings["ours_stats_ms"]
    report.update(head_topk={"checks": checks, "timings": timings, "shape": [rows, vocab], "top_k": top_k})
    return ok


def stage_fused_ops(out: Path, cfg: dict, deadline: float) -> bool:
    """Both ops' checks and timings (OUT/fused_ops.json); passes when every check does."""
    s = sizes(cfg["dry_run"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = Report(out / "fused_ops.json", dtype=str(s["dtype"]), device=device)
    return _conv(s, device, report, deadline) & _head(s, device, report, deadline)
