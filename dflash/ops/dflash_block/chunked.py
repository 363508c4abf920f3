"""Block attention of long samples on the CPU: the plain reference (`naive.py`) run on chunks of a
sample's blocks, each chunk recomputed in backward.

The plain reference keeps its scores for backward: about 17 bytes per (row, context key) pair per
layer at 2 heads, rows x sample length in all (a 65,536-token sample with 2,048 anchors of block 16:
2^31 pairs, 36 GB a layer). Here the blocks of a sample are sorted by anchor and cut into chunks of
at most `CHUNK_SCORES` scores (chunk rows x the context span they see x query heads); a chunk sees
context rows [its first anchor - window + 1, its last anchor), so in a sliding layer its span is
the window plus its anchors' spread. The forward keeps only the output; the backward recomputes one
chunk at a time. Memory: one chunk's scores, whatever the sample's length or anchors. Exact: a
block's output depends only on its own rows and the context it sees (the visibility rule is
relative, the context keys carry RoPE already), and every chunk runs the plain reference.
"""
from __future__ import annotations

import torch

from .naive import dflash_block_attention_naive

CHUNK_SCORES = 1 << 22  # scores per chunk: 8 + 2 x dtype bytes each at its backward's peak (measured), 64 MB in fp32
# A sliding layer's chunk spans at most twice its window (about half its scores visible), unless it is so
# small that its ops' overhead would cost more than the masked scores.
SMALL_CHUNK_SCORES = 1 << 18
REFERENCE_SCORES = 1 << 26  # past this many (rows x sample length x heads) kept for backward: chunked
# Without gradients the reference keeps nothing and holds one sample's scores at a time: chunked past
# this many in one sample (1 GiB in fp32; a demo's held-out walk stays below it, and so on the plain path)
FORWARD_SCORES = 1 << 28


def reference_scores(rows_times_length: int, heads: int) -> int:
    """The scores the plain reference computes at most: rows x their sample's length, summed, x query heads
    (the quantity `dflash.sizing.memory` prices and `dflash_block_attention` compares with REFERENCE_SCORES)."""
    return rows_times_length * heads


def runs_chunked(cu_seqlens_ctx: torch.Tensor, block_seq: torch.Tensor, block_size: int, heads: int,
                 grad: bool) -> bool:
    """Whether the reference runs in chunks: with gradients, past REFERENCE_SCORES scores in all; without,
    past FORWARD_SCORES in one sample."""
    lengths = (cu_seqlens_ctx[1:] - cu_seqlens_ctx[:-1]).long()  # host sync: the reference loops on the host
    per_block = lengths[block_seq.long()] * block_size
    if grad:
        return reference_scores(int(per_block.sum()), heads) > REFERENCE_SCORES
    per_sample = torch.zeros_like(lengths).index_add_(0, block_seq.long(), per_block)
    return per_sample.numel() > 0 and reference_scores(int(per_sample.max()), heads) > FORWARD_SCORES


def chunk_blocks(cu_seqlens: list[int], block_seq: torch.Tensor, block_anchor: torch.Tensor, block_size: int,
                 heads: int, window: int | None, budget: int) -> list[tuple]:
    """(block indices, first and end context row, the blocks' anchors from the first row) of every chunk: per
    sample, blocks by anchor, as many as keep rows x (span + block) x heads within `budget` (one at least)
    and, in a sliding layer, the span within twice the window."""
    seqs, anchors = block_seq.tolist(), block_anchor.tolist()
    by_sample: dict[int, list[int]] = {}
    for j in sorted(range(len(seqs)), key=lambda j: (seqs[j], anchors[j])):
        by_sample.setdefault(seqs[j], []).append(j)
    chunks = []
    for s, blocks in by_sample.items():
        bos, eos = cu_seqlens[s], cu_seqlens[s + 1]
        if anchors[blocks[-1]] > eos - bos:
            raise ValueError(f"an anchor of sample {s} lies past its length {eos - bos}")
        i = 0
        while i < len(blocks):
            lo = 0 if window is None else max(0, anchors[blocks[i]] - window + 1)
            n = 1
            while i + n < len(blocks):
                span = anchors[blocks[i + n]] - lo
                scores = (n + 1) * block_size * heads * (span + block_size)
                if scores > budget or (window is not None and span > 2 * window and scores > SMALL_CHUNK_SCORES):
                    break
                n += 1
            part = blocks[i:i + n]
            relative = torch.tensor([anchors[j] - lo for j in part], dtype=torch.int32)
            chunks.append((torch.tensor(part), bos + lo, bos + anchors[part[-1]], relative))
            i += n
    return chunks


def _rows(blocks: torch.Tensor, block_size: int, device) -> torch.Tensor:
    return (blocks[:, None] * block_size + torch.arange(block_size)).flatten().to(device)


def _chunk(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_size, scale, window, causal):
    """The plain reference on one chunk: its rows and its context rows as a sample of their own."""
    seq = torch.zeros(anchors.numel(), dtype=torch.int32, device=q.device)
    cu = torch.tensor([0, k_ctx.shape[0]], dtype=torch.int32, device=q.device)
    return dflash_block_attention_naive(q, k_ctx, v_ctx, k_blk, v_blk, cu, seq, anchors.to(q.device), block_size,
                                        softmax_scale=scale, window=window, causal=causal)


class _ChunkedBlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, chunks, block_size, scale, window, causal):
        out = q.new_empty(q.shape)
        for blocks, lo, hi, anchors in chunks:
            rows = _rows(blocks, block_size, q.device)
            out[rows] = _chunk(q[rows], k_ctx[lo:hi], v_ctx[lo:hi], k_blk[rows], v_blk[rows], anchors, block_size,
                               scale, window, causal)
        ctx.save_for_backward(q, k_ctx, v_ctx, k_blk, v_blk)
        ctx.chunks, ctx.settings = chunks, (block_size, scale, window, causal)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_ctx, v_ctx, k_blk, v_blk = ctx.saved_tensors
        block_size = ctx.settings[0]
        grads = [torch.zeros_like(x) if need else None
                 for x, need in zip((q, k_ctx, v_ctx, k_blk, v_blk), ctx.needs_input_grad[:5], strict=True)]
        for blocks, lo, hi, anchors in ctx.chunks:
            rows = _rows(blocks, block_size, q.device)
            where = (rows, slice(lo, hi), slice(lo, hi), rows, rows)
            with torch.enable_grad():
                leaves = [x[w].detach().requires_grad_(g is not None)
                          for x, w, g in zip((q, k_ctx, v_ctx, k_blk, v_blk), where, grads, strict=True)]
                out = _chunk(*leaves, anchors, *ctx.settings)
                wanted = [x for x, g in zip(leaves, grads, strict=True) if g is not None]
                got = iter(torch.autograd.grad(out, wanted, dout[rows]))
            for g, w in zip(grads, where, strict=True):
                if g is not None:
                    g[w] += next(got)  # context rows: chunks overlap; block rows: each in one chunk
        return (*grads, None, None, None, None, None)


def dflash_block_attention_chunked(q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens_ctx, block_seq, block_anchor,
                                   block_size, softmax_scale=None, window=None, causal=False,
                                   budget: int | None = None) -> torch.Tensor:
    """`dflash_block_attention_naive`'s result, computed in chunks of at most `budget` scores (default
    CHUNK_SCORES), recomputed in backward (same arguments)."""
    if block_seq.numel() == 0:
        return q.new_zeros(q.shape)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    chunks = chunk_blocks(cu_seqlens_ctx.tolist(), block_seq, block_anchor, block_size, q.shape[1], window,
                          CHUNK_SCORES if budget is None else budget)
    return _ChunkedBlockAttention.apply(q, k_ctx, v_ctx, k_blk, v_blk, chunks, block_size, scale, window, causal)
