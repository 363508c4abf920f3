"""What the CPU's block attention, the plain PyTorch reference (`dflash.ops.dflash_block.naive`),
holds beyond the kernels' output and log-sum-exp, for the memory plan: 0 with the kernels
(`setup.attention != "reference"`). `row_keys` is the sum over a micro-batch's samples of rows x
length; past REFERENCE_SCORES scores the reference runs in chunks recomputed in backward
(`dflash.ops.dflash_block.chunked`), and holds one chunk at a time instead.

`drafter` is a `DrafterSizes`, `setup` a `MemorySetup` (`dflash.sizing.memory`).
"""
from __future__ import annotations


def runs_chunked(drafter, setup, row_keys: int) -> bool:
    """Whether the reference runs in chunks at `row_keys` (the rule `dflash_block_attention` applies)."""
    from dflash.ops.dflash_block.chunked import REFERENCE_SCORES, reference_scores  # ops import on use

    return setup.attention == "reference" and reference_scores(row_keys, drafter.heads) > REFERENCE_SCORES


def unchunked_rows(drafter, setup, tokens: int) -> int | None:
    """The most rows a micro-batch of `tokens` tokens has with the reference unchunked (its scores
    at most rows x tokens); None without the reference."""
    from dflash.ops.dflash_block.chunked import REFERENCE_SCORES

    if setup.attention != "reference" or tokens < 1:
        return None
    return REFERENCE_SCORES // drafter.heads // tokens


def saved_per_layer(drafter, setup, rows: int, row_keys: int) -> int:
    """What it saves for backward in one layer: per (row, context key) pair and head its fp32 softmax
    and one copy of it at the training dtype (the value einsum's operand), per pair the visibility
    mask; per row the same for its B block keys, and the copies of q, k and v its per-sample gather
    makes. Chunked: only the output, as the kernels."""
    if setup.attention != "reference" or runs_chunked(drafter, setup, row_keys):
        return 0
    d, b, B = drafter, setup.dtype_bytes, setup.block_size
    per_pair = d.heads * (4 + b)
    return row_keys * (per_pair + 1) + rows * (B * per_pair + (d.heads + 2 * d.kv_heads) * d.head_dim * b)


def backward_per_layer(drafter, setup, rows: int, row_keys: int) -> int:
    """Its backward in one layer: the gradients of one sample's context scores at once (fp32 and the
    training dtype per pair and head; the largest sample's pairs at most: its rows, `num_anchors` x B,
    by the batch's mean length, `row_keys` / rows) and of every row's q, k and v. Measured on the
    reference alone, fp32: 8 bytes per pair and head with 2-4 heads (12 with one head, whose forward
    the plan prices high); its block keys' scores and the layer's slack cover the rest (whole steps,
    docs/BENCHMARKS.md). Chunked: 0 here, `chunk_in_flight` instead."""
    if setup.attention != "reference" or not rows or runs_chunked(drafter, setup, row_keys):
        return 0
    d, b = drafter, setup.dtype_bytes
    pairs = min(row_keys, -(-row_keys // rows) * setup.num_anchors * setup.block_size)
    return pairs * d.heads * (4 + b) + rows * (d.heads + 2 * d.kv_heads) * d.head_dim * b


def chunk_in_flight(drafter, setup, row_keys: int) -> int:
    """Chunked: one chunk's scores, 8 + 2 x dtype bytes each at its backward's peak (measured)."""
    if not runs_chunked(drafter, setup, row_keys):
        return 0
    from dflash.ops.dflash_block.chunked import CHUNK_SCORES

    return CHUNK_SCORES * (8 + 2 * setup.dtype_bytes)
