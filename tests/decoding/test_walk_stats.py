"""WalkStats through its all-reduce vector: every sum comes back in its own field, as its own type."""
from dataclasses import fields

import numpy as np
import pytest

from dflash.decoding.walk_stats import WalkStats

TEMPERATURES = (0.0, 0.7, 1.0)
NAMES = ("selector_rows", "selector_correct")  # a loss term's named sums (`LogitTerm.metric_names`)


def distinct_stats() -> WalkStats:
    """Stats whose every summed field holds values no other field holds."""
    stats = WalkStats(block_size=4, temperatures=TEMPERATURES, metric_names=NAMES)
    for i, f in enumerate(fields(stats)):
        zero = getattr(stats, f.name)
        if f.name in ("block_size", "temperatures", "metric_names", "figures"):
            continue
        if isinstance(zero, dict):
            setattr(stats, f.name, {name: i + 0.25 + k for k, name in enumerate(NAMES)})
        elif isinstance(zero, np.ndarray):
            setattr(stats, f.name, (np.arange(zero.size) + 100 * i).astype(zero.dtype))
        else:
            setattr(stats, f.name, i + 0.5 if isinstance(zero, float) else i)
    return stats


def test_every_sum_comes_back_from_the_vector_in_its_field():
    stats = distinct_stats()
    back = WalkStats.from_tensor(stats.to_tensor(), 4, TEMPERATURES, NAMES)
    for f in fields(stats):
        sent, got = getattr(stats, f.name), getattr(back, f.name)
        assert type(got) is type(sent), f.name
        if isinstance(sent, np.ndarray):
            assert got.dtype == sent.dtype and np.array_equal(got, sent), f.name
        else:
            assert got == sent, f.name
    assert back.metrics() == stats.metrics()


def test_sums_add_field_by_field_and_a_vector_of_another_walk_is_refused():
    stats = distinct_stats()
    total = WalkStats.from_tensor(stats.to_tensor(), 4, TEMPERATURES, NAMES)
    total.add(stats)
    assert total.metric_sums == {name: 2 * v for name, v in stats.metric_sums.items()}
    assert total.tokens == 2 * stats.tokens and total.loss_sum == 2 * stats.loss_sum
    assert np.array_equal(total.cross, 2 * stats.cross) and np.array_equal(total.slot_count, 2 * stats.slot_count)
    with pytest.raises(ValueError, match="sums for a walk that holds"):
        WalkStats.from_tensor(stats.to_tensor(), 4, (0.0,), NAMES)
