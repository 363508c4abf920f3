"""Public entry points of the frozen head's fused statistics and in-place backward (validation, dispatch)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..common.backend import HAS_TRITON, is_interpreting
from .naive import head_topk_backward_naive_, head_topk_naive

BACKENDS = ("auto", "triton", "torch")


class HeadStats(NamedTuple):
    """Per row of a chunk, of the mapped logits z = softcap tanh(logit_scale raw / softcap)."""

    lse: torch.Tensor  # (rows,) float32 log-sum-exp of z
    gold: torch.Tensor  # (rows,) float32 z[label]
    argmax: torch.Tensor  # (rows,) int64, the first id of the largest z
    top_values: torch.Tensor  # (rows, K) float32, the K largest z, descending
    top_ids: torch.Tensor  # (rows, K) int64 their ids (equal values: the lower id first)


def _use_triton(logits: torch.Tensor, backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    runs = HAS_TRITON and (logits.is_cuda or (logits.device.type == "cpu" and is_interpreting()))
    if backend == "triton" and not (runs and logits.dtype != torch.float64):
        raise RuntimeError('backend="triton" needs triton and CUDA tensors (or TRITON_INTERPRET=1 on the CPU), '
                           f'not float64; got {logits.device}, {logits.dtype}')
    return backend == "triton" or (backend == "auto" and HAS_TRITON and logits.is_cuda
                                   and logits.dtype != torch.float64)


def _check(logits, labels, logit_scale, softcap):
    if logits.dim() != 2 or not logits.is_floating_point() or not logits.is_contiguous():
        raise ValueError(f"logits must be a contiguous float (rows, vocab) tensor, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    if labels.shape != logits.shape[:1] or labels.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"labels must be ({logits.shape[0]},) integer ids, got {tuple(labels.shape)} {labels.dtype}")
    if logits.shape[1] >= 2**31:
        raise ValueError(f"the vocabulary must have fewer than 2**31 ids, got {logits.shape[1]}")
    if not logit_scale > 0 or (softcap is not None and not softcap > 0):
        raise ValueError(f"logit_scale and softcap must be > 0, got {logit_scale} and {softcap}")


def head_topk(logits: torch.Tensor, labels: torch.Tensor, top_k: int, *, logit_scale: float = 1.0,
              softcap: float | None = None, backend: str = "auto", deterministic: bool | None = None) -> HeadStats:
    """What the loss room needs from one chunk of the frozen lm_head's logits, in one read of them.

    Args:
        logits: (rows, V) raw logits hidden @ lm_head.T in the compute dtype (float32/bfloat16/float16),
            contiguous; read only.
        labels: (rows,) int ids in [0, V) (a row that is not scored may hold any valid id).
        top_k: K >= 0 candidates per row (0: none), K <= V.
        logit_scale, softcap: z = softcap tanh(logit_scale raw / softcap), or logit_scale raw when softcap is
            None (a DFlash2 drafter's output multiplier and final logit softcapping).
        backend: "triton" (CUDA, or CPU with TRITON_INTERPRET=1), "torch" (the reference on an fp32 copy),
            "auto" (Triton on CUDA). deterministic: Triton only, True runs pinned configs (no timing); the
            results never depend on timings either way.

    Returns:
        `HeadStats` (fp32 reductions whatever the logits' dtype). The top-K is torch.topk's set; among equal
        values the kernels keep the lower ids (torch.topk does not say which).

    Example:
        >>> stats = head_topk(h @ lm_head.T, labels, 16, logit_scale=0.7, softcap=30.0)
    """
    _check(logits, labels, logit_scale, softcap)
    if not 0 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [0, {logits.shape[1]}], got {top_k}")
    if not _use_triton(logits, backend) or logits.shape[0] == 0:
        return HeadStats(*head_topk_naive(logits, labels, top_k, logit_scale, softcap))
    from .triton_kernels import head_topk_triton

    pinned = torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic)
    return HeadStats(*head_topk_triton(logits, labels, top_k, float(logit_scale), softcap, pinned))


def head_topk_backward_(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor, *,
                        logit_scale: float = 1.0, softcap: float | None = None, backend: str = "auto",
                        deterministic: bool | None = None) -> torch.Tensor:
    """The cross-entropy's gradient with respect to the raw logits, written over them (no second buffer):
    logits[r, v] <- coef[r] (softmax(z)[v] - [v = label]) dz/draw[v], in the logits' dtype (one rounding).
    lse: `HeadStats.lse`; coef: (rows,) float32, each row's weight (0: no gradient). Returns logits."""
    _check(logits, labels, logit_scale, softcap)
    if lse.shape != labels.shape or coef.shape != labels.shape:
        raise ValueError(f"lse and coef must be ({labels.shape[0]},), got {tuple(lse.shape)} and {tuple(coef.shape)}")
    if not _use_triton(logits, backend) or logits.shape[0] == 0:
        return head_topk_backward_naive_(logits, labels, lse, coef, logit_scale, softcap)
    from .triton_kernels import head_topk_backward_triton_

    pinned = torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic)
    return head_topk_backward_triton_(logits, labels, lse.float().contiguous(), coef.float().contiguous(),
                                      float(logit_scale), softcap, pinned)
