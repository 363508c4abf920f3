"""Input validation for the public attention functions (readable errors before any launch)."""
from __future__ import annotations

import torch

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float64: reference only


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names=("q", "k", "v"),
              value_head_dim: bool = False) -> None:
    """q (*, Hq, D), k/v (*, Hkv, D): same dtype/device/head_dim, Hq a multiple of Hkv. With
    `value_head_dim`, v may have a head dim of its own (k and v still agree in rows and heads)."""
    for name, t in zip(names, (q, k, v), strict=True):
        if t.dim() != 3:
            raise ValueError(f"{name} must be (tokens, heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} must be a float tensor (float32, bfloat16, float16; float64 for the reference), "
                            f"got {t.dtype}")
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} is {t.dtype} on {t.device} but {names[0]} is {q.dtype} on {q.device}")
        if t.shape[-1] != q.shape[-1] and not (value_head_dim and t is v):
            raise ValueError(f"{name} has head_dim {t.shape[-1]}, {names[0]} has {q.shape[-1]}")
    if k.shape[:-1] != v.shape[:-1] or (k.shape != v.shape and not value_head_dim):
        raise ValueError(f"{names[1]} {tuple(k.shape)} and {names[2]} {tuple(v.shape)} differ")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


def check_index(name: str, t: torch.Tensor, device: torch.device, length: int | None = None) -> None:
    """An int32 1-D index tensor on the inputs' device (with `length` entries when given)."""
    if t.dtype != torch.int32 or t.dim() != 1:
        raise TypeError(f"{name} must be a 1-D int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the inputs are on {device}")
    if length is not None and t.numel() != length:
        raise ValueError(f"{name} must have {length} entries, got {t.numel()}")


def check_cu_seqlens(name: str, cu_seqlens: torch.Tensor, total: int, cu_seqlens_cpu: torch.Tensor | None) -> None:
    """`cu_seqlens` starts at 0, never decreases and ends at `total`, the packed rows (rows past its
    end would be left unwritten, a decrease would read another sample's rows).

    Checked on the host copy (cu_seqlens_cpu, or cu_seqlens itself on the CPU); on CUDA without one,
    on the device without a host sync (torch._assert_async: a bad batch stops the process with a
    device-side assert)."""
    if cu_seqlens.numel() == 0:
        raise ValueError(f"{name} needs at least one entry (0, then the end of each sample)")
    if cu_seqlens_cpu is not None and cu_seqlens_cpu.shape != cu_seqlens.shape:
        raise ValueError(f"cu_seqlens_cpu has {cu_seqlens_cpu.numel()} entries but {name} has {cu_seqlens.numel()}")
    host = cu_seqlens if cu_seqlens.device.type == "cpu" else cu_seqlens_cpu
    if host is None:
        ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == total) & (cu_seqlens[1:] >= cu_seqlens[:-1]).all()
        torch._assert_async(ok, f"{name} must start at 0, never decrease and end at the {total} packed rows")
        return
    if int(host[0]) != 0 or int(host[-1]) != total:
        raise ValueError(f"{name} must start at 0 and end at {total} (the packed rows), got {int(host[0])} ... "
                         f"{int(host[-1])}")
    down = (host[1:] < host[:-1]).nonzero()
    if down.numel():
        i = int(down[0, 0]) + 1
        raise ValueError(f"{name} decreases at entry {i}: {int(host[i - 1])} then {int(host[i])}")


def check_max_seqlen(cu_seqlens_cpu: torch.Tensor, max_seqlen: int) -> None:
    """max_seqlen must bound every sample of the host copy of cu_seqlens."""
    lengths = cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]
    if lengths.numel() and int(lengths.max()) > max_seqlen:
        longest = int(lengths.argmax())
        raise ValueError(f"max_seqlen is {max_seqlen} but sample {longest} has {int(lengths[longest])} rows")


def check_blocks(cu_seqlens: torch.Tensor, block_seq: torch.Tensor, block_anchor: torch.Tensor) -> None:
    """Every block names a sample of cu_seqlens and an anchor in [0, that sample's length].

    Checked on the device without a host sync (torch._assert_async): on CUDA a bad batch stops
    the process with a device-side assert instead of reading another sample's rows."""
    num_seqs = cu_seqlens.numel() - 1
    if block_seq.numel() == 0:
        return
    if num_seqs == 0:
        raise ValueError("blocks were given but cu_seqlens_ctx holds no sample")
    seq = block_seq.long()
    seq_ok = (seq >= 0) & (seq < num_seqs)
    s = seq.clamp(0, num_seqs - 1)
    length = cu_seqlens[s + 1] - cu_seqlens[s]
    ok = seq_ok & (block_anchor >= 0) & (block_anchor <= length)
    torch._assert_async(ok.all(), "a block's sample is not in cu_seqlens_ctx or its anchor lies past "
                                  "that sample's length (block_seq / block_anchor)")
