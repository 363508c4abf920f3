"""The C++ hot loops against their Python twins and against independent brute-force references."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.data import packing

BUDGET = 64
streams = st.lists(st.integers(1, BUDGET), min_size=0, max_size=200)

requires_native = pytest.mark.skipif(not packing.native_available(), reason="dflash._C not built")


def split_bins(items, offsets):
    return [items[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


@requires_native
@settings(max_examples=200, deadline=None)
@given(streams, st.integers(1, 9))
def test_native_packer_matches_python_twin(lengths, window):
    native = packing.pack_best_fit(lengths, BUDGET, window)
    python = packing.pack_best_fit(lengths, BUDGET, window, force_python=True)
    assert split_bins(*native) == split_bins(*python)


@requires_native
@settings(max_examples=200, deadline=None)
@given(streams)
def test_native_padded_greedy_matches_python_twin(lengths):
    python = packing.pad_greedy(lengths, BUDGET, force_python=True)
    assert packing.pad_greedy(lengths, BUDGET).tolist() == python.tolist()


@requires_native
@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=60, unique=True), st.integers(1, 7), st.randoms())
def test_native_partition_matches_python_twin(values, k, rnd):
    values = np.sort(values)
    counts = np.asarray([rnd.randint(1, 50) for _ in values])
    native = packing.optimal_partition(values, counts, k)
    assert native.tolist() == packing.optimal_partition(values, counts, k, force_python=True).tolist()


@settings(max_examples=200, deadline=None)
@given(streams, st.integers(1, 9))
def test_packed_bins_respect_budget_and_hold_every_item_once(lengths, window):
    items, offsets = packing.pack_best_fit(lengths, BUDGET, window)
    assert sorted(items.tolist()) == list(range(len(lengths)))
    for b in split_bins(items, offsets):
        assert b, "empty bin"
        assert sum(lengths[i] for i in b) <= BUDGET
        assert b == sorted(b), "items of a bin keep stream order"


def best_fit_unbounded(lengths, budget):
    """Textbook best fit with every bin kept open: a bin list scanned for the tightest fit."""
    bins = []
    for i, x in enumerate(lengths):
        fits = [(budget - sum(lengths[j] for j in b), n) for n, b in enumerate(bins)
                if budget - sum(lengths[j] for j in b) >= x]
        if fits:
            bins[min(fits)[1]].append(i)
        else:
            bins.append([i])
    return bins


def next_fit(lengths, budget):
    bins, room = [], 0
    for i, x in enumerate(lengths):
        if bins and x <= room:
            bins[-1].append(i)
            room -= x
        else:
            bins.append([i])
            room = budget - x
    return bins


@settings(max_examples=200, deadline=None)
@given(streams)
def test_window_one_is_next_fit_and_unbounded_window_is_best_fit(lengths):
    assert split_bins(*packing.pack_best_fit(lengths, BUDGET, 1)) == next_fit(lengths, BUDGET)
    wide = split_bins(*packing.pack_best_fit(lengths, BUDGET, max(1, len(lengths))))
    assert sorted(wide) == sorted(best_fit_unbounded(lengths, BUDGET))


@settings(max_examples=200, deadline=None)
@given(streams)
def test_padded_batches_are_greedy_and_within_budget(lengths):
    offsets = packing.pad_greedy(lengths, BUDGET)
    assert offsets[0] == 0 and offsets[-1] == len(lengths)
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        batch = lengths[a:b]
        assert len(batch) * max(batch) <= BUDGET
        if b < len(lengths):  # greedy: the next item would not have fitted
            assert (len(batch) + 1) * max(max(batch), lengths[b]) > BUDGET


def brute_force_partition_cost(values, counts, k):
    best = None
    d = len(values)
    for cuts in itertools.chain.from_iterable(itertools.combinations(range(d - 1), r) for r in range(k)):
        ends = list(cuts) + [d - 1]
        start, cost = 0, 0
        for e in ends:
            cost += sum(counts[start : e + 1]) * values[e]
            start = e + 1
        best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=9, unique=True), st.integers(1, 5), st.randoms())
def test_optimal_partition_matches_brute_force(values, k, rnd):
    values = sorted(values)
    counts = [rnd.randint(1, 20) for _ in values]
    ends = packing.optimal_partition(values, counts, k)
    assert len(ends) == min(k, len(values)) and ends[-1] == len(values) - 1
    start, cost = 0, 0
    for e in ends.tolist():
        cost += sum(counts[start : e + 1]) * values[e]
        start = e + 1
    assert cost == brute_force_partition_cost(values, counts, k)


def test_lengths_outside_the_budget_are_refused():
    from dflash.errors import UserError

    with pytest.raises(UserError, match="stream item 1 has length 65"):
        packing.pack_best_fit([3, 65], BUDGET, 4)


ROW_BUDGET = 40
with_rows = st.lists(st.tuples(st.integers(1, BUDGET), st.integers(0, ROW_BUDGET)), min_size=0, max_size=200)


@requires_native
@settings(max_examples=150, deadline=None)
@given(with_rows, st.integers(1, 9))
def test_native_packers_with_a_row_budget_match_python_twins(items, window):
    lengths, rows = [x for x, _ in items], [r for _, r in items]
    caps = {"rows": rows, "row_budget": ROW_BUDGET}
    native = packing.pack_best_fit(lengths, BUDGET, window, **caps)
    assert split_bins(*native) == split_bins(*packing.pack_best_fit(lengths, BUDGET, window, force_python=True, **caps))
    assert packing.pad_greedy(lengths, BUDGET, **caps).tolist() == packing.pad_greedy(
        lengths, BUDGET, force_python=True, **caps).tolist()


@settings(max_examples=150, deadline=None)
@given(with_rows, st.integers(1, 9))
def test_bins_respect_both_budgets_and_unbounded_best_fit_is_textbook(items, window):
    lengths, rows = [x for x, _ in items], [r for _, r in items]
    bins = split_bins(*packing.pack_best_fit(lengths, BUDGET, window, rows=rows, row_budget=ROW_BUDGET))
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= BUDGET and sum(rows[i] for i in b) <= ROW_BUDGET for b in bins)
    # every bin kept open: the tightest token room among the bins where tokens and rows both fit
    open_bins = []
    for i, (x, r) in enumerate(items):
        fits = [(BUDGET - sum(lengths[j] for j in b), n) for n, b in enumerate(open_bins)
                if BUDGET - sum(lengths[j] for j in b) >= x and ROW_BUDGET - sum(rows[j] for j in b) >= r]
        if fits:
            open_bins[min(fits)[1]].append(i)
        else:
            open_bins.append([i])
    wide = split_bins(*packing.pack_best_fit(lengths, BUDGET, max(1, len(lengths)), rows=rows, row_budget=ROW_BUDGET))
    assert sorted(wide) == sorted(open_bins)
    offsets = packing.pad_greedy(lengths, BUDGET, rows=rows, row_budget=ROW_BUDGET)
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        assert (b - a) * max(lengths[a:b]) <= BUDGET and sum(rows[a:b]) <= ROW_BUDGET
        if b < len(lengths):  # greedy: the next item would have broken one of the budgets
            assert (b - a + 1) * max(lengths[a : b + 1]) > BUDGET or sum(rows[a : b + 1]) > ROW_BUDGET


def test_rows_over_the_row_budget_are_refused():
    from dflash.errors import UserError

    with pytest.raises(UserError, match="stream item 1 has 41 drafter rows"):
        packing.pack_best_fit([3, 5], BUDGET, 4, rows=[0, 41], row_budget=ROW_BUDGET)
