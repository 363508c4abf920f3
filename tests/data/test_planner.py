"""plan_batches and BatchPlanner: every invariant the trainer and DeepSpeed rely on."""
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.data import BatchPlanner, PlannerConfig, optimal_buckets, plan_batches, quantile_buckets
from dflash.data.buckets import padded_cost
from dflash.data.plan_stats import plan_stats
from dflash.data.planner import LAYOUTS, ORDERS
from dflash.errors import UserError

MODES = [pytest.param(o, l, id=f"{o}-{l}") for o in ORDERS for l in LAYOUTS]


def cost(lengths, batch, layout):
    return len(batch) * lengths[batch].max() if layout == "padded" else lengths[batch].sum()


@pytest.mark.parametrize("order,layout", MODES)
@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=300), world_size=st.integers(1, 5),
       seed=st.integers(0, 3), epoch=st.integers(0, 3))
def test_every_sample_once_within_budget_and_equal_counts_per_rank(order, layout, lengths, world_size, seed, epoch):
    lengths = np.asarray(lengths)
    if len(lengths) < world_size:
        with pytest.raises(UserError, match="same number of micro-batches"):
            plan_batches(lengths, PlannerConfig(128, order, layout, seed=seed, world_size=world_size), epoch=epoch)
        return
    plan = plan_batches(lengths, PlannerConfig(128, order, layout, seed=seed, world_size=world_size), epoch=epoch)
    assert len(plan) == world_size
    assert len({len(rank) for rank in plan}) == 1
    flat = np.concatenate([b for rank in plan for b in rank])
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    assert all(len(b) and cost(lengths, b, layout) <= 128 for rank in plan for b in rank)
    again = plan_batches(lengths, PlannerConfig(128, order, layout, seed=seed, world_size=world_size), epoch=epoch)
    assert [[b.tolist() for b in r] for r in plan] == [[b.tolist() for b in r] for r in again]


@pytest.fixture(scope="module")
def lengths():
    return np.random.default_rng(0).integers(10, 2000, size=3000)


def compositions(plan):
    return {tuple(sorted(b.tolist())) for rank in plan for b in rank}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sorted_keeps_compositions_and_reshuffles_batch_order(lengths, layout):
    e0, e1 = (plan_batches(lengths, PlannerConfig(8192, "sorted", layout), epoch=e)[0] for e in (0, 1))
    assert compositions([e0]) == compositions([e1])
    assert [b.tolist() for b in e0] != [b.tolist() for b in e1]
    # batches are contiguous runs of the length-sorted order
    rank_in_sorted = np.argsort(np.argsort(lengths, kind="stable"), kind="stable")
    for b in e0:
        r = np.sort(rank_in_sorted[b])
        assert r[-1] - r[0] == len(r) - 1


@pytest.mark.parametrize("order", ["shuffle", "bucketed"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_orders_redraw_compositions_every_epoch(lengths, order, layout):
    e0, e1 = (plan_batches(lengths, PlannerConfig(8192, order, layout), epoch=e) for e in (0, 1))
    assert len(compositions(e0) & compositions(e1)) < 0.05 * len(compositions(e0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bucketed_batches_stay_inside_one_bucket(lengths, layout):
    edges = [0, 300, 900, 2000]
    plan = plan_batches(lengths, PlannerConfig(8192, "bucketed", layout, boundaries=edges[1:-1]))
    for b in plan[0]:
        buckets = np.searchsorted(edges[1:-1], lengths[b], side="left")
        assert len(set(buckets.tolist())) == 1


def test_bucketed_interleaves_buckets(lengths):
    plan = plan_batches(lengths, PlannerConfig(8192, "bucketed", "padded", boundaries=[300, 900]))[0]
    first_bucket = [int(np.searchsorted([300, 900], lengths[b[0]], side="left")) for b in plan]
    changes = sum(a != b for a, b in pairwise(first_bucket))
    assert changes > len(plan) // 3  # not bucket after bucket


def test_packed_shuffle_batches_mix_lengths_like_iid_draws(lengths):
    batches = plan_batches(lengths, PlannerConfig(8192, "shuffle", "packed"))[0]
    stats = plan_stats(lengths, batches, "packed", 8192)
    iid = plan_stats(lengths, np.array_split(np.random.default_rng(1).permutation(len(lengths)), len(batches)),
                     "packed", 8192)
    assert stats["length_r2"] < 2 * iid["length_r2"]
    assert stats["fill"] > 0.98


@pytest.mark.parametrize("layout", LAYOUTS)
def test_single_sample_batches_are_merged_to_balance_ranks_or_refused(layout):
    from dflash.data.rank_counts import equal_counts

    lengths = np.array([45, 95, 30])
    balanced = equal_counts([np.array([0]), np.array([1]), np.array([2])], lengths, 100, layout, 2)
    assert sorted(sorted(b.tolist()) for b in balanced) == [[0, 2], [1]]
    with pytest.raises(UserError, match="no 1 merges of them fit together in the token budget 100"):
        plan_batches(np.array([60, 90, 95]), PlannerConfig(100, "shuffle", layout, world_size=2))


def test_merging_backtracks_when_the_cheapest_pair_leaves_too_few():
    from dflash.data.rank_counts import equal_counts

    # 5 batches on 3 ranks need 2 merges: the cheapest pair (10 + 15) leaves none that fits,
    # 10 + 88 and 15 + 85 do
    lengths = np.array([10, 15, 85, 88, 95])
    balanced = equal_counts([np.array([i]) for i in range(5)], lengths, 100, "packed", 3)
    assert [b.tolist() for b in balanced] == [[0, 3], [1, 2], [4]]


def test_sample_over_budget_is_named():
    with pytest.raises(UserError, match=r"sample 2 has 900 tokens, more than --token-budget 512"):
        plan_batches(np.array([10, 20, 900]), PlannerConfig(512, "shuffle", "packed"))


@pytest.mark.parametrize("bad,match", [(("nope", "packed"), "order must be"), (("shuffle", "dense"), "layout must be")])
def test_unknown_order_or_layout_is_refused(bad, match):
    with pytest.raises(UserError, match=match):
        plan_batches(np.array([1, 2]), PlannerConfig(8, *bad))


def test_optimal_buckets_beat_quantiles_on_padded_cost(lengths):
    opt, quant = optimal_buckets(lengths, 4, 8192), quantile_buckets(lengths, 4, 8192)
    assert opt[0] == 0 and opt[-1] == lengths.max() and len(opt) == 5
    assert padded_cost(lengths, opt) <= padded_cost(lengths, quant)


def test_planner_resume_continues_with_the_next_micro_batch(lengths):
    config = PlannerConfig(token_budget=8192, order="shuffle", layout="packed", seed=3, world_size=2)
    ref = BatchPlanner(lengths, config)
    seen = []
    for _ in range(ref.steps_in_epoch(0) + 5):  # run across an epoch boundary
        seen.append([ref.batch(r, ref.epoch, ref.position).tolist() for r in range(2)])
        ref.advance()
    run = BatchPlanner(lengths, config)
    run.advance(7)
    resumed = BatchPlanner(lengths, config)
    resumed.load_state_dict(run.state_dict())
    for expected in seen[7:]:
        assert [resumed.batch(r, resumed.epoch, resumed.position).tolist() for r in range(2)] == expected
        resumed.advance()


def test_planner_refuses_other_settings_unless_forced(lengths):
    a = BatchPlanner(lengths, PlannerConfig(token_budget=8192, world_size=2))
    a.advance(3)
    b = BatchPlanner(lengths, PlannerConfig(token_budget=8192, world_size=4))
    with pytest.raises(UserError, match=r"world_size: checkpoint 2 -> now 4"):
        b.load_state_dict(a.state_dict())
    diffs = b.load_state_dict(a.state_dict(), force=True)
    assert any("world_size" in d for d in diffs) and (b.epoch, b.position) == (0, 3)
    c = BatchPlanner(lengths[:-1], PlannerConfig(token_budget=8192, world_size=2))
    with pytest.raises(UserError, match="num_samples"):
        c.load_state_dict(a.state_dict())
