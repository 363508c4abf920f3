"""Public entry point of DFlash block attention (validation, defaults, backend dispatch)."""
from __future__ import annotations

import torch

from ..common.backend import auto_falls_back, resolve_backend
from ..common.checks import check_blocks, check_cu_seqlens, check_index, check_qkv
from .naive import dflash_block_attention_naive


def dflash_block_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    cu_seqlens_ctx: torch.Tensor,
    block_seq: torch.Tensor,
    block_anchor: torch.Tensor,
    block_size: int,
    *,
    softmax_scale: float | None = None,
    backend: str = "auto",
    cu_seqlens_cpu: torch.Tensor | None = None,
    deterministic: bool | None = None,
    window: int | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """The DFlash drafter's attention: each block sees its sample's context before its anchor
    and its own slots (differentiable in q, k_ctx, v_ctx, k_blk, v_blk); `window` / `causal`
    limit both as vLLM and SGLang do for a drafter's `sliding_attention` layers.

    Args:
        q: (NB*B, Hq, D) float32/bfloat16/float16; rows [j*B, (j+1)*B) are block j.
        k_ctx, v_ctx: (T, Hkv, D) packed context rows (the target features' keys/values),
            samples laid out by cu_seqlens_ctx; Hq a multiple of Hkv (GQA as in
            `varlen_attention`).
        k_blk, v_blk: (NB*B, Hkv, D), the blocks' own keys/values, rows as in q.
        cu_seqlens_ctx: int32 (S+1,), sample i is context rows [cu[i], cu[i+1]); cu[0] = 0,
            cu[S] = T, non-decreasing (checked as in `varlen_attention`).
        block_seq: int32 (NB,), the sample of each block.
        block_anchor: int32 (NB,), each block's anchor position inside its sample,
            0 <= anchor <= that sample's length. Blocks may overlap and come in any order.
        block_size: B.
        softmax_scale: defaults to D ** -0.5.
        backend: one of dflash.ops.ATTENTION_BACKENDS: "triton", "torch" (the per-sample
            reference; in chunks recomputed in backward past `chunked.REFERENCE_SCORES` scores, rows
            x sample length x heads, or without gradients past `chunked.FORWARD_SCORES` in one sample:
            `chunked.py`), "auto" (Triton on CUDA, the reference
            elsewhere), "flex" (FlexAttention with a block mask; forward only on the CPU);
            "torch_varlen" and "flash_attn" mean "flex" here.
        cu_seqlens_cpu: optional CPU copy of cu_seqlens_ctx (exact grid without a device read).
        deterministic: Triton backward only. False: dQ from the context is accumulated with
            atomics (5 GEMMs per tile pair; its last bits vary from run to run). True: a second
            kernel recomputes it in a fixed order (7 GEMMs, bitwise repeatable). None (default):
            `torch.are_deterministic_algorithms_enabled()`.
        window: None (full attention) or W >= 1, the Hugging Face `sliding_window`: slot k of a
            block anchored at a (position a+k) sees only keys at positions p with
            a+k-W < p, the query itself counted. Context row j is at position j, slot i at a+i.
        causal: slot k sees slots i <= k of its block only (else all of them, or with a window
            those with |i - k| < W).

    Returns:
        (NB*B, Hq, D) in q's dtype.

    Every row of block j (sample s, anchor a) sees context rows [cu[s], cu[s] + a) and the B
    rows of block j, in both directions. Sample of length 6, B = 2, anchors 3 and 0
    (keys: 6 context positions, then the 2+2 block rows); right: window=3, causal=True (the
    rule of a sliding layer, docs/ARCHITECTURE.md "Drafter layer types")::

                    ctx 0..5      blk0  blk1          ctx 0..5      blk0  blk1
        blk0 slot0  x x x . . .   x x   . .           . x x . . .   x .   . .
        blk0 slot1  x x x . . .   x x   . .           . . x . . .   x x   . .
        blk1 slot0  . . . . . .   . .   x x           . . . . . .   . .   x .
        blk1 slot1  . . . . . .   . .   x x           . . . . . .   . .   x x

    Example:
        >>> out = dflash_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, batch.cu_seqlens,
        ...                              block_seq, block_anchor, 16)
    """
    check_qkv(q, k_ctx, v_ctx, names=("q", "k_ctx", "v_ctx"))
    check_qkv(q, k_blk, v_blk, names=("q", "k_blk", "v_blk"))
    if k_blk.shape[1] != k_ctx.shape[1]:
        raise ValueError(f"k_blk has {k_blk.shape[1]} heads but k_ctx has {k_ctx.shape[1]}")
    num_blocks = block_seq.numel()
    if block_size < 1 or q.shape[0] != num_blocks * block_size or k_blk.shape[0] != q.shape[0]:
        raise ValueError(f"q and k_blk/v_blk must have num_blocks * block_size = {num_blocks} * "
                         f"{block_size} rows, got {q.shape[0]} and {k_blk.shape[0]}")
    check_index("cu_seqlens_ctx", cu_seqlens_ctx, q.device)
    check_cu_seqlens("cu_seqlens_ctx", cu_seqlens_ctx, k_ctx.shape[0], cu_seqlens_cpu)
    check_index("block_seq", block_seq, q.device)
    check_index("block_anchor", block_anchor, q.device, num_blocks)
    if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
        raise ValueError(f"window must be None or an integer >= 1, got {window!r}")
    causal = bool(causal)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if not scale > 0:  # the kernels take the row maximum of unscaled scores
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    impl = resolve_backend(backend, q.device, op="block")
    if impl == "torch":  # the reference checks the anchors itself
        from .chunked import dflash_block_attention_chunked, runs_chunked

        if runs_chunked(cu_seqlens_ctx, block_seq, block_size, q.shape[1],
                        torch.is_grad_enabled() and any(x.requires_grad for x in (q, k_ctx, v_ctx, k_blk, v_blk))):
            return dflash_block_attention_chunked(q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens_ctx, block_seq,
                                                  block_anchor, block_size, softmax_scale=scale, window=window,
                                                  causal=causal)
        return dflash_block_attention_naive(q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens_ctx, block_seq,
                                            block_anchor, block_size, softmax_scale=scale, window=window,
                                            causal=causal)
    check_blocks(cu_seqlens_ctx, block_seq, block_anchor)
    if impl == "flex":
        from .flex import dflash_block_attention_flex

        return dflash_block_attention_flex(q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens_ctx, block_seq, block_anchor,
                                           block_size, scale, window, causal)
    from .triton_kernels import dflash_block_attention_triton, unservable

    deterministic = torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic)
    if backend == "auto" and auto_falls_back(unservable, q.shape[-1], q.shape[1], k_ctx.shape[1], q.dtype,
                                             block_size, deterministic, window is not None, causal):
        from .flex import dflash_block_attention_flex

        return dflash_block_attention_flex(q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens_ctx, block_seq, block_anchor,
                                           block_size, scale, window, causal)
    return dflash_block_attention_triton(q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens_ctx, block_seq,
                                         block_anchor, block_size, scale, cu_seqlens_cpu, deterministic, window,
                                         causal)
