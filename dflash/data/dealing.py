"""Dealing micro-batches to the ranks by cost: the ranks of one micro-batch index get micro-batches of
similar cost (ZeRO-3 waits for the slowest rank at every forward), and runs of `mix` indices (about
a step) keep a mean length near the epoch's, so that a step still mixes lengths (see
docs/ARCHITECTURE.md, "Cost-balanced dealing")."""
from __future__ import annotations

import numpy as np

DEAL_DEPTH = 8  # runs per dealing window: wider windows match costs closer but line steps up by length
COST_TOLERANCE = 0.02  # micro-batches whose costs differ by less are interchangeable when dealing
SPREAD_IQR = 4.0  # micro-batches whose deviation from the mean length is an outlier by this are spread when dealing


def deal(batches: list, batch_costs: np.ndarray, batch_sizes: np.ndarray, batch_tokens: np.ndarray,
         world_size: int, mix: int, rng: np.random.Generator) -> list:
    """Reorder micro-batches so that global index i * W + r is rank r's i-th micro-batch, with
    similar costs at every index i and mixed lengths over consecutive indices.

    A step's mean length differs from the epoch's by D / samples, D = sum over its samples of
    (length - epoch mean length) = the sum of its micro-batches' deviations `dev` (tokens -
    samples x epoch mean); so the dealer keeps the D of every run of `mix` indices (about one
    step) near zero.

    Windows of W x mix x DEAL_DEPTH consecutive micro-batches (of the already random order) are
    sorted by cost, compared in steps of COST_TOLERANCE (inside a step the random order stays,
    so cost-alike micro-batches of different lengths share an index), and cut into groups of W:
    one group per index, so the ranks of an index wait little. Outliers of `dev` (more than
    SPREAD_IQR interquartile ranges from the median: micro-batches of very many short samples)
    can form a cost level of their own whose D no other group offsets; before the cut they move
    up the cost order (into slightly dearer groups, so their ranks wait a little, never the
    others) to at most about ceil(outliers / runs) per group, so that every run can get some.
    The groups of a window are then drafted into runs of `mix` indices: largest |D| first, a
    negative group to the run of the highest D so far, a positive one to the lowest. Runs come
    in random order inside their window (a short one last, so steps stay aligned with runs),
    groups in random order inside their run. Inside a run the costliest micro-batch of each
    group goes to the rank with the least work so far in the run, so that ranks also finish the
    step together (ZeRO-1/2 wait once per step).
    """
    n = len(batches)
    dev = batch_tokens - batch_sizes * (batch_tokens.sum() / batch_sizes.sum())
    window = np.arange(n) // (world_size * mix * DEAL_DEPTH)
    counts = np.bincount(window) // world_size  # groups per window (windows hold whole groups: n % W == 0)
    runs_in = -(-counts // mix)
    level = np.floor(np.log(np.maximum(batch_costs, 1e-300)) / np.log1p(COST_TOLERANCE))
    order = np.lexsort((level, window))  # cost order inside each window
    # outliers move up the cost order: the j-th of a window to position >= its own, spaced W / cap apart
    q25, q50, q75 = np.percentile(dev, [25, 50, 75])
    outlier = np.abs(dev[order] - q50) > SPREAD_IQR * (q75 - q25)
    key = np.arange(n, dtype=np.float64)
    at = np.flatnonzero(outlier)
    if at.size:
        win = window[at]
        per_window = np.bincount(win, minlength=counts.size)
        spacing = (world_size / np.maximum(1, -(-per_window // runs_in)))[win]
        j = np.arange(at.size) - np.concatenate([[0], np.cumsum(per_window)[:-1]])[win]
        # max over earlier outliers i of the window of (position_i + (j - i) x spacing); positions grow
        # with the window, so one running maximum over all windows restarts at each window's first
        key[at] = j * spacing + np.maximum.accumulate(at - j * spacing)
    groups = order[np.lexsort((key, window[order]))].reshape(-1, world_size)
    g_window = window[groups[:, 0]]
    g_dev = dev[groups].sum(axis=1)
    by_size = np.lexsort((-np.abs(g_dev), g_window))
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    run_dev = np.zeros((counts.size, int(runs_in.max())))
    full = np.arange(run_dev.shape[1]) >= runs_in[:, None]  # windows with fewer runs
    run_size = np.zeros(run_dev.shape, dtype=np.int64)
    run_local = np.empty(len(groups), dtype=np.int64)
    for p in range(int(counts.max())):
        win = np.flatnonzero(counts > p)
        g = by_size[first[win] + p]
        r = np.argmin(np.where(full[win], np.inf, np.sign(g_dev[g])[:, None] * run_dev[win]), axis=1)
        run_local[g] = r
        run_dev[win, r] += g_dev[g]
        run_size[win, r] += 1
        full[win, r] |= run_size[win, r] == mix
    run = np.concatenate([[0], np.cumsum(runs_in)[:-1]])[g_window] + run_local
    # runs in random order inside their window (a short run last), groups in random order inside their run
    run_key = rng.random(int(runs_in.sum()))
    run_key[np.bincount(run, minlength=run_key.size) < mix] = 2.0
    seq = np.lexsort((rng.random(len(groups)), run_key[run], g_window))
    run, groups = run[seq], groups[seq]
    # Inside a run, the costliest micro-batch of each group goes to the rank with the least work so far.
    starts = np.flatnonzero(np.concatenate([[True], run[1:] != run[:-1]]))
    run_index = np.repeat(np.arange(len(starts)), np.diff(np.concatenate([starts, [len(groups)]])))
    slot = np.arange(len(groups)) - starts[run_index]
    load = np.zeros((len(starts), world_size))
    dealt = np.empty_like(groups)
    for j in range(int(slot.max()) + 1):
        at = np.flatnonzero(slot == j)
        members = np.take_along_axis(groups[at], np.argsort(-batch_costs[groups[at]], axis=1, kind="stable"), axis=1)
        ranks = np.argsort(load[run_index[at]], axis=1, kind="stable")
        placed = np.empty_like(members)
        np.put_along_axis(placed, ranks, members, axis=1)
        dealt[at] = placed
        load[run_index[at]] += batch_costs[placed]
    order = dealt.reshape(-1)
    return [batches[i] for i in order]
