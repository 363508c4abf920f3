"""Hot loops of the batch planner: the C++ extension `dflash._C` when built, else the Python
twins below (same algorithm, same output, slower). The planner calls only the three public
functions here.
"""
from __future__ import annotations

import warnings

import numpy as np

from dflash.errors import UserError

try:
    import torch

    from dflash import _C  # noqa: F401  (built by `pip install --no-build-isolation -e .`)
except ImportError as _err:  # no compiler at install time, or installed under build isolation
    _C = None
    _C_IMPORT_ERROR = _err
_warned = False


def native_available() -> bool:
    return _C is not None


def _use_native(force_python: bool) -> bool:
    global _warned
    if force_python:
        return False
    if _C is None and not _warned:
        _warned = True
        warnings.warn(
            f"dflash._C is not built ({_C_IMPORT_ERROR}); the batch planner uses its pure-Python "
            "path (same results, slower). Build it with `pip install --no-build-isolation -e .`.",
            stacklevel=3,
        )
    return _C is not None


def _as_lengths(lengths, budget: int) -> np.ndarray:
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
    bad = np.flatnonzero((lengths <= 0) | (lengths > budget))
    if bad.size:
        raise UserError(
            f"stream item {int(bad[0])} has length {int(lengths[bad[0]])}, outside [1, budget={budget}]"
        )
    return lengths


ROW_BUDGET_NONE = int(np.iinfo(np.int64).max)  # no cap on drafter rows


def _as_rows(rows, lengths: np.ndarray, row_budget: int | None) -> tuple[np.ndarray, int]:
    """Drafter rows per stream item and the row budget; no rows means no row cap."""
    if rows is None:
        return np.zeros_like(lengths), ROW_BUDGET_NONE
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if rows.shape != lengths.shape:
        raise ValueError(f"rows {rows.shape} must match lengths {lengths.shape}")
    row_budget = ROW_BUDGET_NONE if row_budget is None else int(row_budget)
    bad = np.flatnonzero((rows < 0) | (rows > row_budget))
    if bad.size:
        raise UserError(
            f"stream item {int(bad[0])} has {int(rows[bad[0]])} drafter rows, outside [0, row budget={row_budget}]"
        )
    return rows, row_budget


def pad_greedy(lengths, budget: int, *, rows=None, row_budget: int | None = None,
               force_python: bool = False) -> np.ndarray:
    """Split a stream into consecutive padded batches (count x longest <= budget, and the sum
    of `rows` <= `row_budget` when rows are given).

    Returns offsets `(num_batches + 1,)`: batch b is stream positions [off[b], off[b+1]).
    """
    lengths = _as_lengths(lengths, budget)
    rows, row_budget = _as_rows(rows, lengths, row_budget)
    if _use_native(force_python):
        return _C.pad_greedy(torch.from_numpy(lengths), int(budget), torch.from_numpy(rows), row_budget).numpy()
    offsets, count, longest, used = [0], 0, 0, 0
    for i, (x, r) in enumerate(zip(lengths.tolist(), rows.tolist(), strict=True)):
        new_longest = max(longest, x)
        if count > 0 and ((count + 1) * new_longest > budget or used + r > row_budget):
            offsets.append(i)
            count, longest, used = 0, x, 0
        else:
            longest = new_longest
        count += 1
        used += r
    if count:
        offsets.append(len(lengths))
    return np.asarray(offsets, dtype=np.int64)


def pack_best_fit(lengths, budget: int, window: int, *, rows=None, row_budget: int | None = None,
                  force_python: bool = False):
    """Pack a stream into bins of at most `budget` tokens (and at most `row_budget` drafter
    rows when `rows` are given), best fit among `window` open bins.

    An item goes to the open bin with the least token room that still fits its tokens and rows
    (earliest opened on ties); if none fits a new bin opens, closing the fullest open bin by
    tokens (earliest on ties) when `window` are open. Returns `(items, offsets)`: stream
    positions grouped by bin, bins in closing order (leftovers close in opening order at the end).
    """
    lengths = _as_lengths(lengths, budget)
    rows, row_budget = _as_rows(rows, lengths, row_budget)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if _use_native(force_python):
        items, offsets = _C.pack_best_fit(torch.from_numpy(lengths), int(budget), int(window),
                                          torch.from_numpy(rows), row_budget)
        return items.numpy(), offsets.numpy()
    bins: list[list[int]] = []
    open_ids: list[int] = []
    open_room: list[int] = []
    open_rows: list[int] = []
    closed: list[int] = []
    for i, (x, r) in enumerate(zip(lengths.tolist(), rows.tolist(), strict=True)):
        best = -1
        for s, room in enumerate(open_room):
            if room >= x and open_rows[s] >= r and (best < 0 or room < open_room[best]):
                best = s
        if best < 0:
            if len(open_ids) == window:
                fullest = min(range(len(open_room)), key=open_room.__getitem__)
                closed.append(open_ids.pop(fullest))
                open_room.pop(fullest)
                open_rows.pop(fullest)
            open_ids.append(len(bins))
            open_room.append(budget)
            open_rows.append(row_budget)
            bins.append([])
            best = len(open_ids) - 1
        bins[open_ids[best]].append(i)
        open_room[best] -= x
        open_rows[best] -= r
    closed.extend(open_ids)
    items = np.fromiter((i for b in closed for i in bins[b]), dtype=np.int64, count=len(lengths))
    offsets = np.zeros(len(closed) + 1, dtype=np.int64)
    np.cumsum([len(bins[b]) for b in closed], out=offsets[1:])
    return items, offsets


def optimal_partition(values, counts, k: int, *, force_python: bool = False) -> np.ndarray:
    """Exact minimum of sum over buckets of (samples) x (bucket's longest) over contiguous
    partitions of sorted distinct `values` (with `counts`) into at most `k` buckets.

    Returns the index of the last distinct value of each bucket, ascending.
    """
    values = np.ascontiguousarray(values, dtype=np.int64)
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    if values.ndim != 1 or values.shape != counts.shape or values.size == 0:
        raise ValueError("values and counts must be non-empty 1-D arrays of equal size")
    if k < 1:
        raise ValueError(f"number of buckets must be >= 1, got {k}")
    if _use_native(force_python):
        return _C.optimal_partition(torch.from_numpy(values), torch.from_numpy(counts), int(k)).numpy()
    v, d = values.tolist(), len(values)
    k = min(k, d)
    prefix = [0]
    for c in counts.tolist():
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    prev = [prefix[j + 1] * v[j] for j in range(d)]
    split = [[-1] * d for _ in range(k)]
    for layer in range(1, k):
        cur = [inf] * d
        stack = [(layer, d - 1, layer - 1, d - 2)]
        while stack:
            lo, hi, opt_lo, opt_hi = stack.pop()
            if lo > hi:
                continue
            mid = (lo + hi) // 2
            best, best_i = inf, -1
            for i in range(opt_lo, min(opt_hi, mid - 1) + 1):
                if prev[i] == inf:
                    continue
                cost = prev[i] + (prefix[mid + 1] - prefix[i + 1]) * v[mid]
                if cost < best:
                    best, best_i = cost, i
            cur[mid], split[layer][mid] = best, best_i
            stack.append((mid + 1, hi, best_i, opt_hi))
            stack.append((lo, mid - 1, opt_lo, best_i))
        prev = cur
    ends, j = [0] * k, d - 1
    for layer in range(k - 1, -1, -1):
        ends[layer] = j
        if layer:
            j = split[layer][j]
    return np.asarray(ends, dtype=np.int64)
