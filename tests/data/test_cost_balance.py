"""The cost model of a sample and the cost-balanced planner (drafter row budget, dealing to ranks)."""
import dataclasses
import itertools
import json

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dflash.data import BatchPlanner, PlannerConfig, plan_batches
from dflash.data.cost import CostModel, batch_features, drafter_rows, fit
from dflash.data.plan_stats import dealing_stats, length_r2
from dflash.data.planner import LAYOUTS, ORDERS
from dflash.data.supervision import ragged_candidates
from dflash.errors import UserError
from dflash.sizing.flops import flop_cost_model, load_target_config
from dflash.tools import plan_batches as plan_batches_cli

MODES = [pytest.param(o, lay, id=f"{o}-{lay}") for o in ORDERS for lay in LAYOUTS]
BLOCK, ANCHORS = 4, 8
MODEL = CostModel(per_token=1.0, per_pair=0.002, per_row=6.0)


@pytest.fixture(scope="module")
def data():
    """Lengths with a heavy short tail, supervised shares from Beta(4, 2), as in the seed-like data."""
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.uniform(np.log(8), np.log(2000), size=6000)).astype(np.int64)
    supervised = np.clip((lengths * rng.beta(4, 2, lengths.size)).astype(np.int64), 1, lengths)
    rows = drafter_rows(supervised - 1, supervised, BLOCK, ANCHORS)
    return lengths, rows, MODEL.sample_costs(lengths, rows)


def test_flop_coefficients_of_qwen3_8b_by_hand():
    m = flop_cost_model(load_target_config("qwen3-8b"), num_target_layers=34, draft_layers=5)
    layer = 2 * 4096 * (32 * 128 + 2 * 8 * 128) + 2 * 32 * 128 * 4096 + 3 * 2 * 4096 * 12288  # 385.9 MFLOP/token
    assert m.per_row == 3 * 5 * layer + 4 * 4096 * 151936  # ~8.3 GFLOP: drafter fwd+bwd, lm_head fwd+input grad
    assert m.per_pair == 34 * 4 * 32 * 128 / 2  # causal: n^2/2 query-key pairs, QK^T and PV
    assert m.per_token == 34 * layer + 3 * (2 * 5 * 4096 * 4096 + 5 * 2 * 4096 * 2 * 8 * 128)
    assert 13e9 < m.per_token < 14.5e9 and 8.2e9 < m.per_row < 8.4e9


def test_plan_batches_prices_the_released_dflash2_drafter(tmp_path, capsys):
    from dflash.drafter.kinds.dflash2 import released_settings, row_flops

    np.save(tmp_path / "l.npy", np.full(64, 600, dtype=np.int64))
    args = ["--lengths", str(tmp_path / "l.npy"), "--token-budget", "4096", "--json"]
    cli = _plan_cli()
    for extra, stop_grad in (([], False), (["--selector-stop-grad"], True)):
        cli.main([*args, "--drafter-kind", "dflash2", *extra])
        report = json.loads(capsys.readouterr().out)
        assert report["drafter_kind"] == "dflash2"
        assert CostModel(**report["cost_model"]) == flop_cost_model(
            load_target_config("qwen3-8b"), num_target_layers=34, draft_layers=5,
            extra_row_flops=row_flops(4096, 5, 16, released_settings(), stop_grad))
    with pytest.raises(SystemExit):
        cli.main([*args, "--selector-stop-grad"])
    assert "--selector-stop-grad: applies to a DFlash2 drafter: give --drafter-kind dflash2" in capsys.readouterr().err


def test_model_config_is_read_from_a_file_and_bad_names_are_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16, '
                                          '"num_hidden_layers": 2, "vocab_size": 32}')
    assert load_target_config(str(tmp_path)).hidden_size == 8
    with pytest.raises(UserError, match="neither a preset"):
        load_target_config(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text('{"hidden_size": 8}')
    with pytest.raises(UserError, match="missing num_attention_heads"):
        load_target_config(str(tmp_path / "bad.json"))


def test_drafter_rows_follow_the_anchor_sampler():
    # 2*B supervised tokens are needed; anchors are capped at num_anchors
    rows = drafter_rows([3, 7, 100, 0], [7, 8, 200, 8], BLOCK, ANCHORS)
    assert rows.tolist() == [0, BLOCK * 7, BLOCK * ANCHORS, 0]


def test_store_candidates_count_adjacent_supervised_pairs_per_sample():
    rng = np.random.default_rng(3)
    masks = [rng.random(rng.integers(1, 30)) < 0.6 for _ in range(40)]
    chunks = [pa.array([m.astype(np.uint8).tolist() for m in masks[:25]], pa.list_(pa.uint8())),
              pa.array([m.astype(np.uint8).tolist() for m in masks[20:]], pa.list_(pa.uint8())).slice(5)]
    expected = [int(np.sum(m[:-1] & m[1:])) for m in masks]
    assert ragged_candidates(pa.chunked_array(chunks)).tolist() == expected


def test_fit_recovers_a_known_model_and_reports_r2():
    rng = np.random.default_rng(1)
    lengths, rows = rng.integers(10, 500, 400), rng.integers(0, 80, 400)
    batches = np.split(rng.permutation(400), np.sort(rng.choice(np.arange(1, 400), 59, replace=False)))
    truth = CostModel(per_token=2e-6, per_pair=1e-9, per_row=5e-6, per_row_key=1e-9, per_sample=3e-4,
                      per_batch=2e-2, unit="s")
    x = batch_features(lengths, rows, batches)
    seconds = x @ truth.coefficients() * rng.normal(1, 0.01, len(batches))
    model, quality = fit(x, seconds)
    assert quality["r2"] > 0.99 and quality["median_rel_error"] < 0.02
    assert model.per_batch == pytest.approx(2e-2, rel=0.2) and model.per_row == pytest.approx(5e-6, rel=0.2)
    prior = CostModel(per_token=2.0, per_pair=1e-3, per_row=5.0, per_row_key=1e-3)  # FLOPs, right shape
    scaled, quality = fit(x, seconds, prior=prior)
    assert scaled.per_token == pytest.approx(2e-6, rel=0.05) and quality["r2"] > 0.99
    with pytest.raises(UserError, match="at least 3"):
        fit(x[:2], seconds[:2])


def _can_merge(groups: list, merges: int, fits) -> bool:
    """Whether `merges` merges of the micro-batches `groups`, each into a union that `fits`, exist:
    an exhaustive search over merge sequences (a union that fits can be built pair by pair, since
    every part of it fits too), each reached set of merged unions searched once."""
    seen = set()

    def search(groups, merges):
        if merges == 0:
            return True
        key = frozenset(g for g in groups if len(g) > 1)
        if key in seen:
            return False
        seen.add(key)
        for a, b in itertools.combinations(groups, 2):
            if fits(a | b) and search([g for g in groups if g is not a and g is not b] + [a | b], merges - 1):
                return True
        return False

    return search([frozenset(g.tolist()) for g in groups], merges)


@pytest.mark.parametrize("order,layout", MODES)
@settings(max_examples=25, deadline=None)
@given(items=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 40)), min_size=1, max_size=300),
       world_size=st.integers(1, 5), seed=st.integers(0, 3), mix=st.integers(1, 5))
@example(items=[(1, 26), (1, 39), (1, 39), (1, 39)], world_size=3, seed=0, mix=1)  # refused: no pair fits
# refused: one pair fits (sample 5 with any), but 6 micro-batches need two merges for 4 ranks
@example(items=[(1, 32), (1, 33), (1, 33), (1, 33), (1, 33), (2, 0)], world_size=4, seed=0, mix=1)
# possible only by backtracking: the cheapest pair (samples 0 and 1) leaves no pair that fits
@example(items=[(1, 1), (2, 24), (3, 40), (3, 40), (3, 40)], world_size=3, seed=0, mix=1)
def test_balanced_plans_keep_every_invariant_under_both_budgets(order, layout, items, world_size, seed, mix):
    lengths, rows = np.array([x for x, _ in items]), np.array([r for _, r in items])
    config = PlannerConfig(128, order, layout, seed=seed, world_size=world_size, row_budget=64, balance=True, mix=mix)
    data = dict(rows=rows, costs=MODEL.sample_costs(lengths, rows))
    if len(lengths) < world_size:
        with pytest.raises(UserError, match="same number of micro-batches"):
            plan_batches(lengths, config, **data)
        return

    def fits(union):
        union = np.fromiter(union, dtype=np.int64)
        cost = len(union) * lengths[union].max() if layout == "padded" else lengths[union].sum()
        return rows[union].sum() <= 64 and cost <= 128

    try:
        plan = plan_batches(lengths, config, **data)
    except UserError as err:
        # Refused only when it cannot be done: the packed micro-batches (one rank's plan, nothing
        # re-dealt) do not divide by the ranks, too few hold 2+ samples to split, and no merges of
        # them into unions that fit bring their count down to a multiple of the ranks.
        assert "merges of them fit together" in str(err)
        packed = plan_batches(lengths, dataclasses.replace(config, world_size=1, balance=False), **data)[0]
        splits = -len(packed) % world_size
        assert splits and sum(len(b) - 1 for b in packed) < splits
        assert not _can_merge(packed, len(packed) % world_size, fits), "merges fit, so the plan was possible"
        return
    assert len({len(rank) for rank in plan}) == 1
    flat = np.concatenate([b for rank in plan for b in rank])
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    for b in (b for rank in plan for b in rank):
        assert len(b) and rows[b].sum() <= 64
        assert (len(b) * lengths[b].max() if layout == "padded" else lengths[b].sum()) <= 128
    again = plan_batches(lengths, config, **data)
    assert [[b.tolist() for b in r] for r in plan] == [[b.tolist() for b in r] for r in again]


@pytest.mark.parametrize("order", ORDERS)
def test_balancing_only_deals_the_same_micro_batches_and_evens_out_ranks(data, order):
    lengths, rows, costs = data
    config = PlannerConfig(4096, order, "packed", world_size=8, row_budget=400)
    before = plan_batches(lengths, config, rows=rows, costs=costs)
    after = plan_batches(lengths, dataclasses.replace(config, balance=True), rows=rows, costs=costs)
    compositions = [{tuple(b.tolist()) for rank in plan for b in rank} for plan in (before, after)]
    assert compositions[0] == compositions[1]  # the order's randomness is the order's, not the dealer's
    stats = [dealing_stats(plan, MODEL, rows, "packed", lengths, 4) for plan in (before, after)]
    assert stats[1]["balance_micro"] > 0.95 and stats[1]["balance_micro"] > stats[0]["balance_micro"] + 0.05
    assert stats[1]["balance_step"] > 0.98
    # steps stay at least as mixed in length as the round-robin plan's (equal samples per step)
    assert stats[1]["step_length_r2"] <= stats[0]["step_length_r2"] * 1.1


def test_length_r2_against_a_direct_computation():
    lengths = np.array([1, 2, 3, 10, 20, 30])
    groups = [np.array([0, 3]), np.array([1, 2, 4, 5])]
    means = [lengths[g].mean() for g in groups]
    between = sum(len(g) * (m - lengths.mean()) ** 2 for g, m in zip(groups, means, strict=True)) / len(lengths)
    assert length_r2(lengths, groups) == pytest.approx(between / lengths.var())


def test_row_budget_errors_name_the_sample():
    with pytest.raises(UserError, match="sample 1 has 90 drafter rows, more than the row budget 64"):
        plan_batches(np.array([5, 6]), PlannerConfig(128, "shuffle", "packed", row_budget=64), rows=np.array([1, 90]))
    with pytest.raises(UserError, match="row budget needs the drafter rows"):
        plan_batches(np.array([5, 6]), PlannerConfig(128, "shuffle", "packed", row_budget=64))
    with pytest.raises(UserError, match="sample 0 has cost -1"):
        plan_batches(np.array([5, 6]), PlannerConfig(128, "shuffle", "packed", balance=True),
                     costs=np.array([-1.0, 1.0]))


def test_balanced_planner_resumes_exactly_and_fingerprints_its_settings(data):
    lengths, rows, costs = data
    config = PlannerConfig(token_budget=4096, order="bucketed", world_size=4, row_budget=400, balance=True)
    ref = BatchPlanner(lengths, config, rows=rows, costs=costs)
    seen = []
    for _ in range(ref.steps_in_epoch(0) + 3):
        seen.append([ref.batch(r, ref.epoch, ref.position).tolist() for r in range(4)])
        ref.advance()
    run = BatchPlanner(lengths, config, rows=rows, costs=costs)
    run.advance(5)
    resumed = BatchPlanner(lengths, config, rows=rows, costs=costs)
    resumed.load_state_dict(run.state_dict())
    for expected in seen[5:]:
        assert [resumed.batch(r, resumed.epoch, resumed.position).tolist() for r in range(4)] == expected
        resumed.advance()
    off = BatchPlanner(lengths, PlannerConfig(**{**config.__dict__, "balance": False}), rows=rows, costs=costs)
    with pytest.raises(UserError, match="balance: checkpoint True -> now False"):
        off.load_state_dict(run.state_dict())
    other = BatchPlanner(lengths, config, rows=rows, costs=costs * 2)
    with pytest.raises(UserError, match="costs_crc32"):
        other.load_state_dict(run.state_dict())


def _plan_cli():
    return plan_batches_cli


def test_plan_batches_saves_every_mode_as_dealt(tmp_path, data, capsys):
    lengths, rows, _ = data
    supervised = np.clip((lengths * 0.7).astype(np.int64), 1, lengths)
    np.save(tmp_path / "l.npy", lengths)
    np.save(tmp_path / "s.npy", supervised)
    cli = _plan_cli()
    args = ["--lengths", str(tmp_path / "l.npy"), "--supervised", str(tmp_path / "s.npy"), "--token-budget", "4096",
            "--world-size", "4", "--block-size", "4", "--anchors", "8", "--row-budget", "400", "--json"]
    cli.main([*args, "--save-plan", str(tmp_path / "plan.npz")])
    report = json.loads(capsys.readouterr().out)
    saved = np.load(tmp_path / "plan.npz")
    assert len(saved.files) == 3 * len(ORDERS) * len(LAYOUTS)
    cand_rows = drafter_rows(supervised - 1, supervised, 4, 8)
    costs = CostModel(**report["cost_model"]).sample_costs(lengths, cand_rows)
    for order in ORDERS:
        samples, offsets, ranks = (saved[f"{order}-packed/{k}"] for k in ("samples", "offsets", "ranks"))
        assert sorted(samples.tolist()) == list(range(lengths.size))
        config = PlannerConfig(4096, order, "packed", world_size=4, row_budget=400, balance=True)
        expected = plan_batches(lengths, config, rows=cand_rows, costs=costs)
        for r in range(4):
            mine = [samples[offsets[i] : offsets[i + 1]].tolist() for i in np.flatnonzero(ranks == r)]
            assert mine == [b.tolist() for b in expected[r]]
        assert report[f"{order}-packed"]["balanced"]["rows_max"] <= 400
    np.save(tmp_path / "bad.npy", supervised[:-1])
    with pytest.raises(SystemExit):
        cli.main([*args, "--supervised", str(tmp_path / "bad.npy")])
    assert f"{lengths.size - 1} counts for {lengths.size} lengths" in capsys.readouterr().err
    cli.main(args[:2] + args[4:])  # no --supervised: every token counts as supervised
    assert "every token counted as supervised" in capsys.readouterr().err


def test_checkpoints_from_before_cost_balancing_resume_into_an_unbalanced_planner(data):
    lengths = data[0]
    planner = BatchPlanner(lengths, PlannerConfig(token_budget=4096, world_size=2))
    planner.advance(3)
    state = planner.state_dict()
    for key in ("row_budget", "balance", "mix", "rows_crc32", "costs_crc32"):
        del state["fingerprint"][key]
    assert BatchPlanner(lengths, PlannerConfig(token_budget=4096, world_size=2)).load_state_dict(state) == []
    with pytest.raises(UserError, match="balance: checkpoint False -> now True"):
        BatchPlanner(lengths, PlannerConfig(token_budget=4096, world_size=2, balance=True)).load_state_dict(state)


def test_a_cost_level_of_many_short_samples_does_not_clump_one_step():
    """A few micro-batches of very many short samples, cheaper than the dearest but alone at their
    cost level (fewer than W of them per dealing window), must not all join one index: that step's
    mean length would sit far below the epoch's. Per-step length mixing stays at least the
    round-robin plan's."""
    rng = np.random.default_rng(3)
    short = rng.integers(8, 17, size=14_000)  # ~20 micro-batches of ~680 samples
    middle = rng.integers(200, 1000, size=4_000)
    long = rng.integers(1000, 2000, size=3_000)
    lengths = np.concatenate([short, middle, long])
    # cost levels: middle ~8K per micro-batch, short ~12K, long ~16K
    costs = lengths * np.concatenate([np.full(short.size, 1.5), np.ones(middle.size), np.full(long.size, 2.0)])
    steps = []
    for balance in (False, True):
        config = PlannerConfig(8192, "bucketed", "packed", boundaries=(16, 1000), world_size=16, mix=4, balance=balance)
        plan = plan_batches(lengths, config, costs=costs)
        batches = [plan[r][i] for i in range(len(plan[0])) for r in range(16)]
        steps.append([np.concatenate(batches[s:s + 64]) for s in range(0, len(batches), 64)])
    assert length_r2(lengths, steps[1]) <= length_r2(lengths, steps[0])


@pytest.mark.parametrize("case", ["supervised NaN", "lengths inf", "cost model NaN"])
def test_non_finite_cost_inputs_are_refused_naming_the_file_and_sample(tmp_path, capsys, case):
    from dflash.training.config import load_config

    lengths = np.full(64, 300, dtype=np.int64)
    np.save(tmp_path / "l.npy", lengths)
    args = ["--lengths", str(tmp_path / "l.npy"), "--token-budget", "4096"]
    if case == "cost model NaN":  # Python's json writes and reads NaN
        (tmp_path / "cost.json").write_text(json.dumps({"per_token": 1.0, "per_row": float("nan")}))
        with pytest.raises(UserError, match=rf"--cost-model: {tmp_path / 'cost.json'}: per_row is nan; every "
                                            "coefficient of a cost model must be finite"):
            load_config(["--cost-model", str(tmp_path / "cost.json")])
        return
    values = lengths.astype(np.float64)
    values[5] = np.nan if case == "supervised NaN" else np.inf
    flag = "--supervised" if case == "supervised NaN" else "--lengths"
    np.save(tmp_path / "bad.npy", values)
    with pytest.raises(SystemExit) as exit_info:
        _plan_cli().main([*args, flag, str(tmp_path / "bad.npy")])
    assert exit_info.value.code == 2
    assert f"error: {flag} {tmp_path / 'bad.npy'}: sample 5 has {values[5]} tokens" in capsys.readouterr().err

