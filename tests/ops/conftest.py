"""Shared fixtures for the attention-op tests.

Without CUDA the Triton kernels run in the numpy interpreter, which must be switched on before
triton is first imported (the ops import it lazily, so setting it here is early enough).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Relative RMS error allowed regardless of the low-precision reference's own error. On CUDA
# the kernels' fp32 dots run in TF32.
_FLOOR = {torch.float32: 5e-3 if DEVICE == "cuda" else 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(autouse=True)
def nan_poisoned_empty(monkeypatch):
    """torch.empty / empty_like return NaN-filled float tensors, so unwritten outputs show."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def _rel_rms(x, ref):
    """RMS of the error over the RMS of ref, the latter floored at 1e-2: a gradient that is
    exactly zero (a one-token sample's dq) is then compared in absolute terms."""
    rms = ref.double().pow(2).mean().sqrt().clamp_min(1e-2)
    return ((x.double() - ref.double()).pow(2).mean().sqrt() / rms).item()


@pytest.fixture
def check_close():
    """check_close(name, out, ref, low=None): out against the high-precision `ref`.

    The relative RMS error must stay within 2x that of `low` (the reference computed in the
    inputs' own precision: what the dtype itself costs), with a floor per dtype.
    """

    def check(name, out, ref, low=None):
        assert torch.isfinite(out).all(), f"{name}: non-finite values (unwritten output?)"
        err = _rel_rms(out, ref)
        bound = max(2 * _rel_rms(low, ref) if low is not None else 0.0, _FLOOR[out.dtype])
        assert err <= bound, f"{name}: relative RMS error {err:.2e} > {bound:.2e}"

    return check


@pytest.fixture
def count_specializations():
    """count_specializations(kernels) -> callable returning how many distinct compilations the
    launches of `kernels` (autotuned Triton kernels) have needed since the fixture was made.

    On CUDA this is the number of autotune keys (the autotuner compiles every config of a key,
    so Triton's kernel cache holds several entries per key). In the interpreter nothing
    compiles, so every launch's arguments go through the same specialization binder Triton uses
    to pick a cached kernel, and the distinct keys are counted.
    """
    hooks = []

    def start(kernels):
        if DEVICE == "cuda":
            def size():
                return sum(len(k.cache) for k in kernels)
            before = size()
            return lambda: size() - before
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        keys = set()
        for kernel in kernels:
            fn = kernel.fn  # the InterpretedFunction under the autotuner
            jit = JITFunction(fn.fn, do_not_specialize=fn.kwargs.get("do_not_specialize"))
            binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)

            def hook(*args, _binder=binder, _name=fn.fn.__name__, **kwargs):
                _, spec, options = _binder(*args, **kwargs)
                keys.add(repr((_name, spec, sorted(options.items()))))

            fn.add_pre_run_hook(hook)
            hooks.append((fn, hook))
        return lambda: len(keys)

    yield start
    for fn, hook in hooks:
        fn.pre_run_hooks.remove(hook)
