"""Cost counters: matmul FLOPs of the target feature forward (layers 0..max tap, no
lm_head), and peak tensor memory of any function.

Counted the way `torch.utils.flop_counter.FlopCounterMode` counts a forward: 2*M*N*K per
matmul, and attention as dense per-sample QK^T and PV (4 * n^2 * Hq * D per layer for a
sequence of n rows; a kernel that skips the masked half of a causal tile does about half).
Norms, RoPE, softmax and activations are not matmuls and are not counted.
"""
from __future__ import annotations

from collections.abc import Sequence


def _per_layer(config) -> tuple[int, int]:
    """(linear FLOPs per token, attention FLOPs per query-key pair) of one decoder layer."""
    H = config.hidden_size
    Hq = config.num_attention_heads
    Hkv = getattr(config, "num_key_value_heads", None) or Hq
    D = getattr(config, "head_dim", None) or H // Hq
    linear = 2 * H * (Hq * D + 2 * Hkv * D) + 2 * Hq * D * H + 3 * 2 * H * config.intermediate_size
    return linear, 4 * Hq * D


def target_forward_flops(config, lengths: Sequence[int], num_layers: int, layout: str = "packed") -> int:
    """FLOPs of a feature forward through `num_layers` layers over one micro-batch.

    Args:
        config: the target's Hugging Face config (sizes only).
        lengths: the samples' token counts.
        num_layers: layers run (max(target_layer_ids) + 1).
        layout: "packed" (real tokens only, attention inside each sample) or "padded"
            (every sample padded to the longest: count x longest tokens, longest^2 pairs each).
    """
    linear, pair = _per_layer(config)
    lengths = [int(n) for n in lengths]
    if layout == "packed":
        tokens, pairs = sum(lengths), sum(n * n for n in lengths)
    elif layout == "padded":
        longest = max(lengths, default=0)
        tokens, pairs = len(lengths) * longest, len(lengths) * longest * longest
    else:
        raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
    return num_layers * (tokens * linear + pairs * pair)


def _fused_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    b, hq, s_q, d = query_shape
    return 4 * b * hq * s_q * key_shape[-2] * d


def measure_flops(fn, *args, **kwargs) -> tuple[int, object]:
    """Run fn(*args, **kwargs) under FlopCounterMode; returns (matmul FLOPs, fn's result).

    The CPU's fused SDPA kernel has no formula in torch's counter (it would count 0); it is
    counted here like the other SDPA kernels, dense over query x key.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _fused_sdpa_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        result = fn(*args, **kwargs)
    return counter.get_total_flops(), result


def measure_peak_tensor_bytes(fn, *args, **kwargs) -> tuple[int, object]:
    """Peak bytes of tensor storages created while fn runs (forward and backward alike).

    Every tensor produced by an op is tracked until its storage dies; the peak is taken after
    each op, so it is exact at op granularity on any device (the CPU has no allocator
    statistics). Tensors that existed before the call are not counted.
    """
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class _Peak(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live: dict[int, tuple[StorageWeakRef, int]] = {}
            self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # Views and in-place results alias an input: tracked already, or older than the call.
            inputs = {StorageWeakRef(a.untyped_storage()).cdata
                      for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    ref = StorageWeakRef(t.untyped_storage())
                    if ref.cdata not in inputs:
                        self.live.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
            self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
            self.peak = max(self.peak, sum(n for _, n in self.live.values()))
            return out

    with _Peak() as mode:
        result = fn(*args, **kwargs)
    return mode.peak, result
