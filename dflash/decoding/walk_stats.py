"""The walk's sums over held-out turns (`WalkStats`: they add up over batches and ranks, in one
all-reduce vector) and the figures made of them: tau, tau@T and its standard error, anchor tau,
per-slot accuracy, the loss."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import numpy as np
import torch

# The walk's settings, not sums: every other field of WalkStats adds up.
_SETTINGS = ("block_size", "temperatures", "metric_names", "figures")


def tau_key(temperature: float) -> str:
    """The metric name of the walk at a temperature: tau@0 (greedy, = tau), tau@0.7, tau@1."""
    return f"tau@{temperature:g}"


def stderr_key(temperature: float) -> str:
    """The metric name of tau@T's standard error over turns: tau@1_stderr."""
    return tau_key(temperature) + "_stderr"


def ratio_stderr(n: int, tokens: float, blocks: float, tokens_sq: float, blocks_sq: float,
                 cross: float) -> float | None:
    """The standard error of tau = sum t_i / sum b_i over n turns (t_i tokens, b_i blocks of turn i),
    from the sums of t, b, t^2, b^2 and t b: the delta method, sqrt(sum (t_i - tau b_i)^2 / (n (n-1)))
    / mean b, as `SpeculateReport.acceptance_length_stderr` computes it for decoding. None when n < 2."""
    if n < 2 or blocks <= 0:
        return None
    tau = tokens / blocks
    residual = max(tokens_sq - 2 * tau * cross + tau * tau * blocks_sq, 0.0)
    return float(np.sqrt(residual / (n * (n - 1))) / (blocks / n))


@dataclass
class WalkStats:
    """Sums over held-out turns; `metrics()` turns them into the figures (sums, so ranks add up).
    `temperatures`: those of the walk (`tau@T`); 0 is the greedy walk, each T > 0 has its expected
    blocks in `expected_blocks` (in order). `metric_sums`: the loss terms' named sums
    (`LossOutput.metrics`), of which `metric_names` travel in `to_tensor`, and `figures` turns them
    into figures (`BlockLoss.figures`)."""

    block_size: int
    temperatures: tuple[float, ...] = ()
    metric_names: tuple[str, ...] = ()
    figures: Callable[[dict, float], dict] | None = None
    loss_sum: float = 0.0  # slot-weighted CE over every anchor's block
    weight_sum: float = 0.0
    tokens: int = 0  # turn tokens after each turn's first
    blocks: int = 0  # blocks walked (target forwards of decoding)
    turns: int = 0
    anchor_accepted: int = 0  # sum over every anchor of accepted + 1
    anchors: int = 0
    slot_correct: np.ndarray = field(default=None)  # (B-1,) int64
    slot_count: np.ndarray = field(default=None)
    expected_blocks: np.ndarray = field(default=None)  # (temperatures > 0,) float64: expected blocks walked
    # per-turn second moments, for the standard error of tau@T over turns (t_i tokens, e_i expected blocks)
    tokens_sq: float = 0.0  # sum t_i^2
    blocks_sq: np.ndarray = field(default=None)  # (temperatures > 0,): sum e_i^2
    cross: np.ndarray = field(default=None)  # (temperatures > 0,): sum t_i e_i
    # a drafter whose network chooses the drafts (`LossOutput.argmax_hits`): the greedy walk of the
    # backbone's own argmax beside its path
    argmax_blocks: int = 0
    argmax_anchor_accepted: int = 0
    metric_sums: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("slot_correct", "slot_count"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(self.block_size - 1, dtype=np.int64))
        for name in ("expected_blocks", "blocks_sq", "cross"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(len(self.sampled), dtype=np.float64))

    @property
    def sampled(self) -> tuple[float, ...]:
        """The temperatures > 0, in order (those with expected blocks)."""
        return tuple(t for t in self.temperatures if t > 0)

    def _sums(self) -> list[str]:
        """The summed fields, in declaration order (the layout of `to_tensor`)."""
        return [f.name for f in fields(self) if f.name not in _SETTINGS]

    def add(self, other: WalkStats) -> None:
        for name in self._sums():
            if name == "metric_sums":
                for k, v in other.metric_sums.items():
                    self.metric_sums[k] = self.metric_sums.get(k, 0.0) + v
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))

    def _values(self, name: str) -> list:
        if name == "metric_sums":
            return [float(self.metric_sums.get(k, 0.0)) for k in self.metric_names]
        return np.ravel(getattr(self, name)).tolist()

    def to_tensor(self, device=None) -> torch.Tensor:
        """All sums in one float64 vector (for one all-reduce), field after field (of `metric_sums`,
        those of `metric_names`)."""
        return torch.tensor([x for name in self._sums() for x in self._values(name)], dtype=torch.float64,
                            device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, block_size: int, temperatures=(), metric_names=(),
                    figures=None) -> WalkStats:
        """The sums of a `to_tensor` vector of a walk of `block_size` at `temperatures`: each field takes
        as many values as its zero holds, as its zero's type."""
        v = t.cpu().tolist()
        stats, at = cls(block_size=block_size, temperatures=tuple(temperatures),
                        metric_names=tuple(metric_names), figures=figures), 0
        for name in stats._sums():
            zero = getattr(stats, name)
            if name == "metric_sums":
                stats.metric_sums = dict(zip(stats.metric_names, v[at:at + len(stats.metric_names)], strict=True))
                at += len(stats.metric_names)
            elif isinstance(zero, np.ndarray):
                setattr(stats, name, np.asarray(v[at:at + zero.size], dtype=zero.dtype))
                at += zero.size
            else:
                setattr(stats, name, type(zero)(v[at]))
                at += 1
        if at != len(v):
            raise ValueError(f"a vector of {len(v)} sums for a walk that holds {at}")
        return stats

    def metrics(self) -> dict:
        """The figures; at each T > 0, `tau@T` and its standard error over turns `tau@T_stderr` (None
        with fewer than 2 turns), which counts the spread between turns, as decoding's does."""
        tau = self.tokens / self.blocks if self.blocks else 1.0
        at = {}
        for t in self.temperatures:
            if t == 0:
                at[tau_key(t)] = tau
                continue
            i = self.sampled.index(t)
            blocks = float(self.expected_blocks[i])
            at[tau_key(t)] = self.tokens / blocks if blocks else 1.0
            at[stderr_key(t)] = ratio_stderr(self.turns, self.tokens, blocks, self.tokens_sq, float(self.blocks_sq[i]),
                                             float(self.cross[i]))
        extra = {}
        if self.figures is not None and self.metric_sums:  # the terms' figures, over every anchor's block
            extra = self.figures({**self.metric_sums, "argmax_tau_sum": self.argmax_anchor_accepted}, self.anchors)
        if self.argmax_anchor_accepted:  # the network chose the drafts: `tau` is its path's, `argmax_tau` its argmax's
            extra["argmax_tau"] = self.tokens / self.argmax_blocks if self.argmax_blocks else 1.0
        return {
            "loss": self.loss_sum / max(self.weight_sum, 1e-12),
            "tau": tau,
            **at,
            "anchor_tau": self.anchor_accepted / self.anchors if self.anchors else 1.0,
            "slot_accuracy": (self.slot_correct / np.maximum(self.slot_count, 1)).tolist(),
            "blocks": self.blocks,
            "tokens": self.tokens,
            "turns": self.turns,
            "anchors": self.anchors,
            **extra,
        }

