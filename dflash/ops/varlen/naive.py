"""Plain-PyTorch reference for packed varlen attention: one sample at a time.

Each sample is an ordinary (heads, length, head_dim) attention, so memory is per sample
(never tokens x tokens over the whole pack) and autograd comes from torch. A sliding window
or attention sinks are written out as the textbook softmax over an explicit mask and an extra
sink column, independent of the kernels' tricks, a tile of query rows at a time (heads x tile x the
keys the tile sees).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def varlen_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, Dv), cu_seqlens int (S+1,) -> (T, Hq, Dv)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    bounds = cu_seqlens.tolist()  # host sync: the reference loops on the host anyway
    outs = []
    for bos, eos in zip(bounds[:-1], bounds[1:], strict=True):
        if eos == bos:
            continue
        qs, ks, vs = (t[bos:eos].transpose(0, 1) for t in (q, k, v))  # (H, L, D)
        if window is None and sinks is None:
            # 4-D: on the CPU, 3-D inputs take SDPA's math path (scores of L x L materialised), 4x slower
            # forward and backward at 2,048 tokens and 10x in forward at 6,000 than its fused kernel.
            o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=causal, scale=scale,
                                               enable_gqa=True)[0]
        else:
            o = _explicit_attention(qs, ks, vs, causal, scale, window, sinks)
        outs.append(o.transpose(0, 1))
    if not outs:
        return q.new_zeros((*q.shape[:-1], v.shape[-1]))  # no tokens at all
    return torch.cat(outs)


ROW_TILE = 256  # query rows per softmax of `_explicit_attention`: scores are a tile's, never length x length


def _explicit_attention(q, k, v, causal, scale, window, sinks):
    """softmax([q k^T * scale | sink]) without the sink column, times v; q (Hq, L, D), k/v (Hkv, L, *).
    Key j is visible to row i when j <= i (causal) and i - j < window (the window's keys include i).
    Rows go ROW_TILE at a time against the keys they can see (a long sample with a window: tile x
    (tile + window) scores, where the whole mask of 65,536 tokens would take 16 GB)."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    acc = torch.promote_types(q.dtype, torch.float32)  # low precision inputs: scores in fp32
    length, outs = q.shape[1], []
    for start in range(0, length, ROW_TILE):
        end = min(length, start + ROW_TILE)
        lo, hi = (0 if window is None else max(0, start - window + 1)), (end if causal else length)
        scores = (q[:, start:end].to(acc) @ k[:, lo:hi].to(acc).transpose(1, 2)) * scale  # (Hq, rows, keys)
        i = torch.arange(start, end, device=q.device)[:, None]
        j = torch.arange(lo, hi, device=q.device)[None, :]
        visible = torch.ones(end - start, hi - lo, dtype=torch.bool, device=q.device)
        if causal:
            visible &= j <= i
        if window is not None:
            visible &= i - j < window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.to(acc).view(-1, 1, 1).expand(-1, end - start, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        outs.append(probs @ v[:, lo:hi].to(acc))
    return torch.cat(outs, dim=1).to(q.dtype)
