"""The target's cache in decoding, rolled back to the accepted length after a verify forward.

Attention layers (full or sliding) keep every position's keys and values, so a rejected draft is
cropped off. A recurrent layer (Gated DeltaNet) holds one state for all positions seen: it cannot
be cropped. Before each forward the cache keeps those layers' states (a copy of a few small
tensors per layer); when drafts are rejected they go back to that snapshot, the attention layers
are cropped to the same position, and the accepted tokens are fed again at the front of the next
forward (its outputs for them are dropped), so no extra forward is spent on the rollback.
"""
from __future__ import annotations

import copy
import functools
import inspect
from types import SimpleNamespace

import torch


@functools.cache
def _cache_argument(cls) -> str:
    # transformers >= 5.24 names the KV cache argument `cache` (`past_key_values` before)
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def _is_recurrent(layer) -> bool:
    """A cache layer with state that covers all positions at once (transformers' linear-attention layers)."""
    return hasattr(layer, "recurrent_states") or hasattr(layer, "conv_states")


def has_recurrent_layers(config) -> bool:
    return "linear_attention" in (getattr(config, "layer_types", None) or [])


class TargetCache:
    """Cache of one decoded sequence: `forward(ids)` runs ids after what the cache holds, `keep(n)` keeps
    positions [0, n) of it. Works for dense, MoE, sliding-window, MLA and hybrid targets alike.

    Sliding-window layers keep all positions here (a plain DynamicCache): cropping a window-sized
    cache back past its window is what transformers refuses, and decoding memory is the full cache's.
    """

    def __init__(self, hf) -> None:
        from transformers import DynamicCache

        self.hf = hf
        self.recurrent = has_recurrent_layers(hf.config)
        # Hybrid targets need their per-layer cache types (conv and recurrent states); others a plain cache.
        self.cache = DynamicCache(config=hf.config) if self.recurrent else DynamicCache()
        self.length = 0  # positions the cache holds
        self.pending: list[int] = []  # accepted tokens at positions length.. that the next forward feeds first
        self._fed: list[int] = []
        self._snapshot: dict = {}

    @torch.no_grad()
    def forward(self, ids: list[int], hidden: bool = False):
        """Logits (and with `hidden`, every layer's hidden states) of `ids` at the positions after the
        cache's, as (1, len(ids), ...) tensors; the cache then holds them too."""
        feed = self.pending + list(ids)
        if self.recurrent:
            self._snapshot = {i: copy.deepcopy(layer) for i, layer in enumerate(self.cache.layers)
                              if _is_recurrent(layer)}
        device = self.hf.device
        x = torch.tensor([feed], dtype=torch.long, device=device)
        pos = torch.arange(self.length, self.length + len(feed), device=device)[None]
        out = self.hf(input_ids=x, position_ids=pos, use_cache=True, output_hidden_states=hidden,
                      **{_cache_argument(type(self.hf)): self.cache})
        skip = len(self.pending)
        self._fed, self.pending = feed, []
        self._start, self.length = self.length, self.length + len(feed)
        states = tuple(h[:, skip:] for h in out.hidden_states) if hidden else None
        return SimpleNamespace(logits=out.logits[:, skip:], hidden_states=states)

    def keep(self, length: int) -> None:
        """Keep positions [0, length) (at least those before the last forward)."""
        extra = self.length - length
        if extra < 0 or length < self._start:
            raise ValueError(f"cannot keep {length} positions: the cache holds {self.length}, the last forward "
                             f"started at {self._start}")
        if not extra:
            return
        if not self.recurrent:
            self.cache.crop(-extra)
            self.length = length
            return
        # back to the state before the last forward; its kept tokens go again with the next one
        back = self.length - self._start
        for i, layer in enumerate(self.cache.layers):
            if i in self._snapshot:
                self.cache.layers[i] = self._snapshot[i]
            else:
                layer.crop(-back)
        self._snapshot = {}
        self.pending = self._fed[: length - self._start]
        self.length = self._start
