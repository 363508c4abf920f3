"""What a sample costs to train on: the planner balances this, not tokens.

A sample of `n` tokens with `r` drafter rows (block_size x its anchors) costs

    per_token * n  +  per_pair * n^2  +  per_row * r  +  per_row_key * r * n  +  per_sample
                   +  per_window_pair * w(n)

and a micro-batch the sum over its samples plus `per_batch`. The terms: the frozen target's
linear layers (tokens; linear-attention layers are linear in n too) and causal attention in
its full-attention layers (n^2), its sliding-window layers (w(n) = 2 x the query-key pairs a
window of `window` keys leaves, less n: n^2 up to the window, then growing linearly, so
per_window_pair prices what per_pair does), the drafter's layers and lm_head forward and
backward (rows, the same for every sample with enough anchor candidates whatever its length),
the drafter's attention of every block row to the sample's context (rows x n), and fixed
overheads (per sample: anchor drawing and Python work; per micro-batch: launches, the step's
collectives). `dflash.sizing.flops.flop_cost_model` derives the coefficients from the target's
and drafter's configs; `fit` calibrates them from measured micro-batch times, because on a CPU
the per-sample Python work matters and on an accelerator the GEMMs do.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from dflash.data.supervision import trainable
from dflash.errors import UserError

FEATURES = ("tokens", "pairs", "rows", "row_keys", "samples", "batches", "window_pairs")
BATCH = FEATURES.index("batches")
FLOP_TERMS = [FEATURES.index(f) for f in ("tokens", "pairs", "rows", "row_keys", "window_pairs")]


@dataclass(frozen=True)
class CostModel:
    """Linear cost of a micro-batch in its features (see the module docstring); any unit."""

    per_token: float = 0.0
    per_pair: float = 0.0
    per_row: float = 0.0
    per_row_key: float = 0.0
    per_sample: float = 0.0
    per_batch: float = 0.0
    per_window_pair: float = 0.0
    unit: str = "FLOP"
    window: int = 0  # keys a sliding-window layer's row sees (0: the target has none)

    def coefficients(self) -> np.ndarray:
        """In the order of FEATURES."""
        return np.array([self.per_token, self.per_pair, self.per_row, self.per_row_key, self.per_sample,
                         self.per_batch, self.per_window_pair], dtype=np.float64)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def load(cls, path) -> CostModel:
        """A model saved as JSON (`to_dict`, e.g. compare_modes.py's cost_model.json); errors name the file."""
        import json

        try:
            fields = json.loads(open(path).read())
            kinds = {"unit": str, "window": int}
            model = cls(**{k: kinds.get(k, float)(v) for k, v in fields.items()})
        except (OSError, ValueError, TypeError, OverflowError) as e:  # int(inf) of a window
            raise UserError(f"{path}: not a cost model JSON of {', '.join(asdict(cls()))} ({e})") from None
        bad = [k for k, v in asdict(model).items() if k != "unit" and not math.isfinite(v)]
        if bad:  # JSON as Python writes it allows NaN and Infinity
            raise UserError(f"{path}: {bad[0]} is {fields[bad[0]]}; every coefficient of a cost model must be finite")
        return model

    def sample_costs(self, lengths, rows) -> np.ndarray:
        """`(N,)` cost of every sample (without the per-micro-batch term, whose column is 0 here)."""
        return sample_features(lengths, rows, self.window) @ self.coefficients()

    def batch_costs(self, lengths, rows, batches) -> np.ndarray:
        """`(M,)` cost of every micro-batch (lists of sample indices), per-batch term included."""
        return batch_features(lengths, rows, batches, self.window) @ self.coefficients()


def drafter_rows(candidates, supervised, block_size: int, num_anchors: int) -> np.ndarray:
    """Block rows the drafter scores per sample: block_size x min(num_anchors, candidates),
    0 for a sample the anchor sampler skips (fewer than 2 x block_size supervised tokens)."""
    candidates = np.asarray(candidates, dtype=np.int64)
    supervised = np.asarray(supervised, dtype=np.int64)
    if block_size < 1 or num_anchors < 1:
        raise UserError(f"block size and anchors per sample must be >= 1, got {block_size} and {num_anchors}")
    anchors = np.minimum(num_anchors, np.maximum(candidates, 0))
    return np.where(trainable(supervised, block_size), block_size * anchors, 0).astype(np.int64)


def window_pairs(lengths, window: int) -> np.ndarray:
    """2 x (query, key) pairs of a causal sliding window of `window` keys (its own included) over
    samples of `lengths`, less n: n^2 while n <= window (as the full layers' pairs feature), then
    window (2n - window + 1) - n. 0 for every sample without a window (window 0)."""
    n = np.asarray(lengths, dtype=np.float64)
    if window <= 0:
        return np.zeros_like(n)
    w = float(window)
    inside = np.minimum(n, w)  # rows whose window reaches back to the sample's start
    pairs = inside * (inside + 1) / 2 + (n - inside) * w
    return 2 * pairs - n


def sample_features(lengths, rows, window: int = 0) -> np.ndarray:
    """`(N, 7)` features of every sample in the order of FEATURES (the batch column is 0)."""
    n = np.asarray(lengths, dtype=np.float64)
    r = np.asarray(rows, dtype=np.float64)
    if n.shape != r.shape:
        raise UserError(f"{r.size} drafter row counts for {n.size} samples")
    return np.stack([n, n * n, r, r * n, np.ones_like(n), np.zeros_like(n), window_pairs(n, window)], axis=1)


def batch_features(lengths, rows, batches, window: int = 0) -> np.ndarray:
    """`(M, 7)` features of every micro-batch: sums over its samples, and 1 in the batch column."""
    per_sample = sample_features(lengths, rows, window)
    sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
    if (sizes == 0).any():
        raise UserError("a micro-batch without samples has no cost")
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    sums = np.add.reduceat(per_sample[np.concatenate(batches)], starts, axis=0)
    sums[:, BATCH] = 1.0
    return sums


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: solve, drop the most negative term, repeat (a
    negative time per token or per sample is noise, never a saving)."""
    active = np.ones(a.shape[1], dtype=bool)
    solution = np.zeros(a.shape[1])
    while active.any():
        solution[:] = 0.0
        solution[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        if (solution >= 0).all():
            break
        active[np.argmin(solution)] = False
    return np.maximum(solution, 0.0)


def fit(features, seconds, *, prior: CostModel | None = None, window: int = 0) -> tuple[CostModel, dict]:
    """Least-squares calibration of the cost model from measured micro-batch times.

    Args:
        features: `(M, 7)` `batch_features` of the measured micro-batches.
        seconds: `(M,)` their measured times.
        prior: when given, only scale its FLOP terms (one coefficient for the FLOPs of each
            micro-batch) and fit the per-sample and per-batch overheads beside it: 3 unknowns,
            stable with few measurements; without it, all seven coefficients (non-negative).
        window: the sliding window the features were computed with (without a prior; a prior's own
            window otherwise), kept in the fitted model.

    Returns:
        (model in seconds, {"r2", "median_rel_error", "measurements"}) of the fit on its data.
    """
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(FEATURES) or y.shape != (x.shape[0],):
        raise UserError(f"need (M, {len(FEATURES)}) features and (M,) times, got {x.shape} and {y.shape}")
    if x.shape[0] < 3:
        raise UserError(f"calibration needs at least 3 measured micro-batches, got {x.shape[0]}")
    sample = FEATURES.index("samples")
    if prior is not None:
        flops = x[:, FLOP_TERMS] @ prior.coefficients()[FLOP_TERMS]
        design = np.stack([flops, x[:, sample], x[:, BATCH]], axis=1)
    else:
        design = x
    scale = np.maximum(np.abs(design).max(axis=0), 1e-30)  # conditioning: columns span 1 .. 1e12
    solution = _nonnegative_lstsq(design / scale, y) / scale
    if prior is not None:
        c = prior.coefficients() * solution[0]
        c[sample], c[BATCH] = solution[1], solution[2]
        model = CostModel(*c.tolist(), unit="s", window=prior.window)
    else:
        model = CostModel(*solution.tolist(), unit="s", window=window)
    predicted = x @ model.coefficients()
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - predicted) ** 2).sum()) / total if total > 0 else 1.0
    rel = np.abs(predicted - y) / np.maximum(y, 1e-12)
    return model, {"r2": r2, "median_rel_error": float(np.median(rel)), "measurements": int(y.size)}
