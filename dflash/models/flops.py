"""Cost counters: matmul FLOPs of the target feature forward (layers 0..max tap, no
lm_head), and peak tensor memory of any function.

Counted the way `torch.utils.flop_counter.FlopCounterMode` counts a forward: 2*M*N*K per
matmul, and attention as dense per-sample QK^T and PV (4 * n^2 * Hq * D per layer for a
sequence of n rows; a kernel that skips the masked half of a causal tile does about half).
Norms, RoPE, softmax and activations are not matmuls and are not counted.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

from dflash.errors import UserError

# Sizes of named targets for the cost model (their Hugging Face config.json fields).
PRESETS = {
    "qwen3-8b": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "intermediate_size": 12288, "num_hidden_layers": 36, "vocab_size": 151936},
}


def load_target_config(model: str) -> SimpleNamespace:
    """A named preset (e.g. "qwen3-8b") or the path of a target's config.json (or its folder)."""
    if model in PRESETS:
        return SimpleNamespace(**PRESETS[model])
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UserError(f"--model {model}: neither a preset ({', '.join(PRESETS)}) nor a config.json")
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read a JSON config ({e})") from None
    fields = fields.get("text_config", fields)  # multimodal configs nest the language model's
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                           "vocab_size") if k not in fields]
    if missing:
        raise UserError(f"{path}: missing {', '.join(missing)}; the cost model needs the model's sizes")
    return SimpleNamespace(**fields)


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


def flop_cost_model(target, *, num_target_layers: int, drafter_layers: int = 5, num_features: int = 5,
                    block_size: int = 16):
    """FLOP cost model of one training sample (`dflash.data.cost.CostModel`, unit FLOP).

    Target, frozen, forward only through `num_target_layers` layers: linear per token, causal
    attention n^2/2 pairs per sample. Drafter (its layers sized like the target's, as DFlash
    builds it), per block row: its layers forward and backward (3x a forward) and the frozen
    lm_head forward plus the gradient of its input (2x); per context token: the feature
    projection (num_features x hidden -> hidden) and every layer's K/V projections, trained
    (3x); per row x context token: block attention to the context, about n/2 keys per row
    when anchors are spread over the sample (3x).
    """
    from dflash.data.cost import CostModel

    linear, pair = _per_layer(target)
    H = target.hidden_size
    Hq = target.num_attention_heads
    Hkv = getattr(target, "num_key_value_heads", None) or Hq
    D = getattr(target, "head_dim", None) or H // Hq
    per_row = 3 * drafter_layers * linear + 2 * 2 * H * target.vocab_size
    context = 3 * (2 * num_features * H * H + drafter_layers * 2 * H * 2 * Hkv * D)
    return CostModel(
        per_token=float(num_target_layers * linear + context),
        per_pair=float(num_target_layers * pair / 2),
        per_row=float(per_row),
        per_row_key=float(3 * drafter_layers * pair / 2),
        unit="FLOP",
    )
