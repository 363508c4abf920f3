"""Speculative decoding on the demo target: lossless, and its acceptance length equals the walk tau;
sampled at temperature 1, its acceptance length is the one the walk at temperature predicts.

The turns are regenerated here by the target's own greedy decoding, so the walk over them is the
decoding figure exactly (fp32, CPU): same context features, block content, positions and stop rule.
At temperature 1 the turns are the target's samples, as decoding's outputs are.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from dflash.data.collate import collate_packed
from dflash.decoding import sampling as sampling_module
from dflash.decoding.acceptance import every_anchor, limited, turn_spans, walk, walk_tau
from dflash.decoding.expected_walk import expected_blocks, slot_ratios, target_inputs
from dflash.decoding.sampling import Sampler, Sampling, verify_block
from dflash.decoding.speculate import (
    greedy_decode,
    prompts_from_conversations,
    prompts_from_samples,
    speculate,
    speculative_decode,
)
from dflash.drafter.config_format import SLIDING
from dflash.drafter.kinds.dflash2 import DFlash2Drafter, DFlash2Settings, SelectorTerm
from dflash.models import (
    BlockLoss,
    DFlashDrafter,
    DrafterConfig,
)

from ..demo_turns import LIMIT, fit, score
from ..drafter.official import official_dflash


def make_drafter(demo, seed=0, layers=2, layer_types=None, sliding_window=None):
    torch.manual_seed(seed)
    config = DrafterConfig.from_target(demo["hf"].config, mask_token_id=demo["mask_id"], block_size=16,
                                       draft_layers=layers, target_layer_ids=demo["target"].target_layer_ids,
                                       vocab_size=demo["target"].num_embedding_rows, layer_types=layer_types,
                                       sliding_window=sliding_window)
    return DFlashDrafter(config, demo["target"].shared_weights(), attention_backend="torch")


@pytest.fixture(scope="module")
def trained(demo):
    return fit(demo, make_drafter(demo, seed=1, layers=1))


def test_sliding_drafter_lossless_and_equal_to_walk(demo):
    """A sliding layer (window 12, shorter than the prompts, and than the block plus context) then a
    full one: decoding applies each layer's mask as training does, so the walk is still exact."""
    drafter = fit(demo, make_drafter(demo, seed=2, layer_types=["sliding_attention", "full_attention"],
                                     sliding_window=12))
    lossless, decoded, walked, stats = decode_and_walk(demo, drafter, LIMIT)
    assert lossless
    assert decoded == walked
    assert stats.metrics()["tau"] > 1.15


def decode_and_walk(demo, drafter, limit):
    """(lossless, decoding (tokens, forwards), walk (tokens, blocks)) over the regenerated turns."""
    hf, stops = demo["hf"], demo["stops"]
    tokens = forwards = 0
    lossless = True
    for p, out in zip(demo["prompts"], demo["outs"], strict=True):
        spec = speculative_decode(hf, drafter, p, max_new_tokens=limit, stop_ids=stops)
        lossless &= spec.tokens == out[:limit]  # the target's greedy output
        tokens += len(spec.tokens) - 1
        forwards += spec.forwards
    batch = collate_packed(demo["samples"], range(len(demo["samples"])))
    stats = walk_tau(score(drafter), batch, demo["target"].features(batch),
                     block_size=drafter.block_size, max_turn_tokens=limit, stop_ids=stops, max_blocks=100)
    assert stats.turns == len(demo["prompts"])  # every turn, however short
    return lossless, (tokens, forwards), (stats.tokens, stats.blocks), stats


def test_random_drafter_lossless_and_equal_to_walk(demo):
    lossless, decoded, walked, stats = decode_and_walk(demo, make_drafter(demo).eval(), LIMIT)
    assert lossless
    assert decoded == walked
    assert stats.metrics()["tau"] < 1.2  # an untrained drafter rarely guesses


def test_trained_drafter_lossless_and_equal_to_walk(demo, trained):
    lossless, decoded, walked, stats = decode_and_walk(demo, trained, LIMIT)
    assert lossless
    assert decoded == walked
    assert stats.metrics()["tau"] > 1.15  # drafts are accepted: the equality covers real acceptance


def test_limit_cuts_turns_as_decoding_does(demo, trained):
    lossless, decoded, walked, _ = decode_and_walk(demo, trained, 20)
    assert lossless
    assert decoded == walked


def test_speculate_report(demo, trained, monkeypatch):
    """The report's figures against the turns decoded one by one: acceptance length = tokens after the
    first per verify forward; with a clock that ticks once per target forward, tokens/s is tokens per
    target forward (the target alone: 1 exactly) and the speedup the forwards decoding saves; a turn
    the target alone decodes otherwise is named; without the reference run its figures are None."""
    from types import SimpleNamespace

    import dflash.decoding.speculate as speculate_module

    hf, stops, prompts = demo["hf"], demo["stops"], demo["prompts"][:3]
    alone = [speculative_decode(hf, trained, p, max_new_tokens=LIMIT, stop_ids=stops) for p in prompts]
    target_calls, forward = [0], hf.forward

    def counted(*args, **kwargs):
        target_calls[0] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(hf, "forward", counted)
    monkeypatch.setattr(speculate_module, "time", SimpleNamespace(perf_counter=lambda: float(target_calls[0])))
    s = speculate(hf, trained, prompts, max_new_tokens=LIMIT, stop_ids=stops, progress=False).summary()
    assert s["lossless"] is True and s["mismatched_turns"] == [] and s["turns"] == 3
    assert s["tokens"] == s["reference_tokens"] == sum(len(out) for out in demo["outs"][:3])
    assert s["target_forwards"] == sum(d.forwards for d in alone)
    assert s["acceptance_length"] == sum(len(d.tokens) - 1 for d in alone) / sum(d.forwards for d in alone)
    assert s["acceptance_length"] > 1.05  # drafts are accepted: the ratio counts real acceptance
    # one prefill per turn, then the verify forwards; the target alone: a prefill, then one forward per token
    tokens, forwards = s["tokens"], s["target_forwards"] + 3
    assert s["target_tokens_per_s"] == 1.0 and s["speculative_tokens_per_s"] == tokens / forwards
    assert s["speedup"] == pytest.approx(tokens / forwards) and s["speedup"] > 1
    assert s["acceptance_length_stderr"] is None and s["temperature"] == 0 and s["seed"] is None

    decode = speculate_module.greedy_decode
    calls = []

    def second_turn_differs(*args, **kwargs):
        out = decode(*args, **kwargs)
        calls.append(len(calls))
        if calls[-1] == 1:
            out.tokens[-1] = out.tokens[-1] + 1
        return out

    monkeypatch.setattr(speculate_module, "greedy_decode", second_turn_differs)
    s = speculate(hf, trained, prompts, max_new_tokens=LIMIT, stop_ids=stops, progress=False).summary()
    assert s["lossless"] is False and s["mismatched_turns"] == [1]
    s = speculate(hf, trained, prompts[:1], max_new_tokens=LIMIT, stop_ids=stops, reference=False,
                  progress=False).summary()
    assert len(calls) == 3, "no reference run"
    assert s["lossless"] is s["speedup"] is s["target_tokens_per_s"] is s["reference_tokens"] is None
    assert s["tokens"] == len(alone[0].tokens)
    assert s["speculative_tokens_per_s"] == len(alone[0].tokens) / (alone[0].forwards + 1)


def walk_at(demo, drafter, samples, temperature):
    """Per turn (tokens after the first, expected blocks at the temperature) of the walk over `samples`."""
    out = []
    for sample in samples:
        batch = collate_packed([sample], [0])
        features, logprobs = target_inputs(demo["target"], batch, (temperature,))
        stats = walk_tau(score(drafter), batch, features,
                         block_size=drafter.block_size, max_turn_tokens=LIMIT, stop_ids=demo["stops"],
                         temperatures=(temperature,), target_logprobs=logprobs)
        out.append((stats.tokens, stats.expected_blocks[0]))
    return np.asarray(out)


def ratio_and_error(tokens, blocks):
    """sum tokens / sum blocks over turns, and its standard error (delta method over turns)."""
    tau = tokens.sum() / blocks.sum()
    n = len(tokens)
    return tau, np.sqrt(((tokens - tau * blocks) ** 2).sum() / (n * (n - 1))) / blocks.mean()


def test_walk_at_temperature_predicts_speculative_sampling(demo, trained):
    """tau@1 of the walk over turns the target sampled at temperature 1 against `speculative_decode` at
    temperature 1 of the same prompts (other seeds), within 3 standard errors of the difference; and,
    without path noise, the expected blocks along the speculative outputs themselves against the
    blocks they took (the acceptance coins are the only noise left: z within 3)."""
    hf, stops, repeats = demo["hf"], demo["stops"], 4
    sampling = Sampling(1.0)
    prompts = [p for p in demo["prompts"] for _ in range(repeats)]  # 32 turns
    regenerated = Sampler(sampling, seed=11)
    turns = [demo["sample"](p, greedy_decode(hf, p, max_new_tokens=LIMIT, stop_ids=stops, sampler=regenerated).tokens)
             for p in prompts]
    walked = walk_at(demo, trained, turns, 1.0)
    predicted, predicted_err = ratio_and_error(walked[:, 0], walked[:, 1])

    decoder = Sampler(sampling, seed=12)
    decoded = [speculative_decode(hf, trained, p, max_new_tokens=LIMIT, stop_ids=stops, sampler=decoder)
               for p in prompts]
    forwards = np.asarray([d.forwards for d in decoded], dtype=np.float64)
    tokens = np.asarray([len(d.tokens) - 1 for d in decoded], dtype=np.float64)
    measured, measured_err = ratio_and_error(tokens, forwards)
    assert abs(predicted - measured) < 3 * np.hypot(predicted_err, measured_err), (predicted, measured)
    assert measured > 1.05  # drafts are accepted at temperature 1 too

    along = walk_at(demo, trained, [demo["sample"](p, d.tokens) for p, d in zip(prompts, decoded, strict=True)], 1.0)
    assert np.array_equal(along[:, 0], tokens)
    residual = forwards - along[:, 1]
    assert abs(residual.sum()) < 3 * np.sqrt((residual ** 2).sum()), (forwards.sum(), along[:, 1].sum())


def test_walk_ratios_are_those_of_decoding(demo, trained, monkeypatch):
    """At every block speculative sampling ran (T 1), min(1, q/p) of the tokens it emitted equals the
    walk's ratio at that anchor and slot: the same drafter distribution (cached forward vs scored block)
    and the same target probability (verify forward vs packed forward), position by position."""
    hf, stops, B = demo["hf"], demo["stops"], trained.block_size
    blocks = []

    def recording(drafts, q, p, generator=None):
        accepted, token = verify_block(drafts, q, p, generator)
        emitted = drafts[:accepted].tolist() + [token]
        blocks.append((accepted, [min(1.0, float(q[k, y] / p[k, y])) for k, y in enumerate(emitted[:B - 1])]))
        return accepted, token

    monkeypatch.setattr(sampling_module, "verify_block", recording)
    sampler, compared = Sampler(Sampling(1.0), seed=5), []
    for prompt in demo["prompts"][:4]:
        blocks.clear()
        decoded = speculative_decode(hf, trained, prompt, max_new_tokens=LIMIT, stop_ids=stops, sampler=sampler)
        batch = limited(collate_packed([demo["sample"](prompt, decoded.tokens)], [0]), LIMIT, stops)
        features, logprobs = target_inputs(demo["target"], batch, (1.0,))
        (anchors,) = every_anchor(batch, B)
        positions = anchors.block_anchor.numpy()
        ratios = slot_ratios(score(trained)(batch, features, anchors, temperatures=(1.0,)).label_logq, positions,
                             logprobs)[0]
        anchor = len(prompt)
        for accepted, decoding_ratios in blocks:
            walk_ratios = ratios[int(np.flatnonzero(positions == anchor)[0]), :len(decoding_ratios)]
            np.testing.assert_allclose(walk_ratios, decoding_ratios, rtol=1e-4, atol=1e-6)
            anchor += accepted + 1
            compared.append(accepted)
    assert sum(a > 0 for a in compared) >= 3, compared  # slots after accepted ones were compared too


def test_expected_blocks_of_hits_is_the_walk_and_of_ratios_the_mean_of_sampled_walks():
    rng = np.random.default_rng(0)
    spans = [(2, 15), (15, 16), (20, 39)]
    hits = rng.random((40, 4)) < 0.5
    accepted = np.cumprod(hits, axis=1).sum(axis=1)
    assert expected_blocks(hits.astype(float), spans) == sum(walk(accepted, s, e)[1] for s, e in spans)
    # ratios: the mean number of blocks of walks whose slots are accepted with those probabilities
    ratios = rng.random((40, 4))
    draws = rng.random((4000, 40, 4)) < ratios
    sampled = [sum(walk(np.cumprod(d, axis=1).sum(axis=1), s, e)[1] for s, e in spans) for d in draws]
    assert abs(expected_blocks(ratios, spans) - np.mean(sampled)) < 4 * np.std(sampled) / np.sqrt(len(sampled))


def test_prompts_from_conversations_match_the_tokenized_data(demo, tmp_path):
    from dflash.data.tokenizing import tokenize_conversation
    from dflash.demo import DATA

    with open(DATA) as f:
        lines = [next(f) for _ in range(5)]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(lines) + json.dumps({"messages": [{"role": "user", "content": "Count up from 3 to 9 ."}]}))
    prompts = prompts_from_conversations(path, demo["tok"])
    samples = [tokenize_conversation(demo["tok"], json.loads(x)["messages"], "x") for x in lines]
    assert prompts[:-1] == prompts_from_samples(samples) == demo["prompts"]
    assert demo["tok"].decode(prompts[-1]).endswith("<|im_start|>assistant\n")


def test_speculate_cli_saves_the_runs_heldout_conversations(demo, tmp_path, capsys):
    """--save-heldout writes the lines of the run's data that its held-out split holds (a sample a blank
    line before it moves to another line number, so the source lines, not the store order, are used)."""
    from dflash.data.prepare import ensure_store
    from dflash.data.token_store import TokenStore
    from dflash.data.tokenizing import tokenize_conversation
    from dflash.demo import DATA
    from dflash.training.data import held_out_split

    from ..conftest import launch_script

    cli = launch_script("speculate")
    with open(DATA) as f:
        lines = [next(f) for _ in range(12)]
    data, run = tmp_path / "data.jsonl", tmp_path / "run"
    data.write_text("\n" + "".join(lines))
    ensure_store(data, demo["tok"], run / "data", max_length=1024, progress=False, say=lambda *_: None)
    (run / "config.json").write_text(json.dumps({"data": str(data), "eval_fraction": 0.25, "seed": 3}))
    make_drafter(demo).save_pretrained(run / "drafter")
    result = cli.main(["--drafter", str(run / "drafter"), "--save-heldout", str(tmp_path / "heldout.jsonl")])
    _, eval_idx = held_out_split(12, 0.25, 3)
    assert result == {"heldout_conversations": 3} and "wrote the 3 held-out conversations" in capsys.readouterr().out
    assert (tmp_path / "heldout.jsonl").read_text() == "".join(lines[i] for i in eval_idx)
    saved = [json.loads(x)["messages"] for x in lines]
    store = TokenStore(run / "data")
    for i in eval_idx:
        assert np.array_equal(tokenize_conversation(demo["tok"], saved[i], "x")[0], store[int(i)][0])


def test_walk_against_step_by_step_decoding():
    # accepted[a] for a turn at [2, 12): decoding anchors at 2, jumps accepted + 1, stops at the last token
    accepted = np.array([9, 9, 3, 0, 0, 0, 1, 5, 0, 2, 0, 9])
    assert walk(accepted, 2, 12) == (9, 4)  # anchors 2, 6, 8, 9 -> 9 tokens after the first in 4 blocks
    assert walk(accepted, 2, 3) == (0, 0)  # a one-token turn (just the stop token): no block
    assert turn_spans(np.array([0, 1, 1, 0, 1, 1, 1, 1, 0])) == [(1, 3), (4, 8)]
    assert turn_spans(np.array([0, 1, 1, 0, 1, 1, 1, 1]), max_turn_tokens=3) == [(1, 3), (4, 7)]


def test_every_anchor_covers_short_samples_in_chunks():
    samples = [(np.arange(10), np.array([0, 0, 1, 1, 1, 0, 0, 1, 1, 0], dtype=bool)),
               (np.arange(4), np.array([0, 1, 1, 1], dtype=bool))]
    batch = limited(collate_packed(samples, [0, 1]), 2)
    chunks = every_anchor(batch, block_size=16, max_blocks=2)
    got = [(int(s), int(a)) for p in chunks for s, a in zip(p.block_seq, p.block_anchor, strict=True)]
    assert got == [(0, 2), (0, 7), (1, 1)]  # turns cut to 2 tokens: one anchor each
    assert [p.num_blocks for p in chunks] == [2, 1]
    # decoding stops at the first stop token (9 here), whatever the template supervises after it
    cut = limited(collate_packed([(np.array([5, 1, 9, 4, 2, 9]), np.array([0, 1, 1, 1, 1, 1], dtype=bool))], [0]),
                  None, stop_ids=[9])
    assert cut.loss_mask.tolist() == [False, True, True, False, False, False]


def test_speculate_cli_reports_json_and_names_bad_input(demo, tmp_path, capsys):
    from dflash.demo import DATA, TARGET

    from ..conftest import launch_script

    cli = launch_script("speculate")
    make_drafter(demo).save_pretrained(tmp_path / "drafter")
    result = cli.main(["--drafter", str(tmp_path / "drafter"), "--prompts", str(DATA), "--target", str(TARGET),
                       "--max-turns", "2", "--max-new-tokens", "6", "--json", "--no-progress"])
    assert json.loads(capsys.readouterr().out) == result
    assert result["lossless"] and result["turns"] == 2 and result["max_new_tokens"] == 6
    assert result["tokens"] == 12 and result["speedup"] > 0  # the first demo answers are longer than 6 tokens
    assert result["temperature"] == 0 and result["seed"] is None and result["acceptance_length_stderr"] is None
    sampled = cli.main(["--drafter", str(tmp_path / "drafter"), "--prompts", str(DATA), "--target", str(TARGET),
                        "--max-turns", "2", "--max-new-tokens", "6", "--temperature", "1", "--top-p", "0.9",
                        "--seed", "3", "--json", "--no-progress"])
    assert json.loads(capsys.readouterr().out) == sampled
    assert (sampled["temperature"], sampled["top_p"], sampled["seed"], sampled["drafts"]) == (1.0, 0.9, 3, "sampled")
    assert sampled["lossless"] is None and sampled["turns"] == 2 and sampled["acceptance_length_stderr"] is not None
    with pytest.raises(SystemExit) as e:
        cli.main(["--drafter", str(tmp_path / "drafter"), "--prompts", str(DATA), "--seed", "3"])
    assert e.value.code == 2
    assert "--seed applies only to sampling: give --temperature > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["--drafter", str(tmp_path / "drafter")])  # no --prompts and no run around it
    assert e.value.code == 2
    assert "no run config" in capsys.readouterr().err


def test_heldout_batches_pack_in_order_and_a_longer_sample_alone():
    from dflash.decoding.acceptance import heldout_batches

    def greedy(lengths, budget):  # the rule written out: close the batch when the next sample does not fit
        groups, group, size = [], [], 0
        for i, n in enumerate(lengths):
            if group and size + n > budget:
                groups, group, size = groups + [group], [], 0
            group, size = group + [i], size + n
        return groups + [group] if group else groups

    rng = np.random.default_rng(0)
    for _ in range(300):
        lengths, budget = rng.integers(1, 300, rng.integers(0, 20)), int(rng.integers(50, 400))
        assert [b.tolist() for b in heldout_batches(lengths, budget)] == greedy(lengths.tolist(), budget)
    assert [b.tolist() for b in heldout_batches([5, 900, 5, 5], 10)] == [[0], [1], [2, 3]]


@pytest.fixture(scope="module")
def trained2(demo):
    """A DFlash2 drafter (one all-sliding layer as released, selector top-16 of rank 32) fitted with its
    selector's objective, and that objective: its path accepts far more than its backbone's argmax."""
    torch.manual_seed(1)
    config = DrafterConfig.from_target(demo["hf"].config, mask_token_id=demo["mask_id"], block_size=16,
                                       draft_layers=1, target_layer_ids=demo["target"].target_layer_ids,
                                       vocab_size=demo["target"].num_embedding_rows, layer_types=[SLIDING],
                                       sliding_window=2048, is_causal=False, kind="dflash2",
                                       kind_settings=DFlash2Settings(
                                           conv_kernel_size=2, conv_group_size=16, selector_rank=32,
                                           selector_top_k=16))
    drafter = DFlash2Drafter(config, demo["target"].shared_weights(), attention_backend="torch")
    loss = BlockLoss(terms=[SelectorTerm(drafter.candidate_selector)])
    return fit(demo, drafter, loss=loss), loss


@pytest.fixture(scope="module")
def official():
    """The official code (before the drafter is fitted: a missing wheel skips at once)."""
    return official_dflash()


def official_loop(official, demo, drafter, folder, monkeypatch):
    """z-lab's DFlash2DraftModel loaded from the export of `drafter`, and a function decoding a prompt with
    z-lab's `dflash_generate` -> (generated tokens, tokens produced per verify forward)."""
    drafter.save_pretrained(folder)
    model = official.DFlash2DraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    monkeypatch.setattr(official, "_cuda_time", time.perf_counter)  # its timer synchronises CUDA

    def generate(prompt, temperature=0.0):
        r = official.dflash_generate(model, demo["hf"], torch.tensor([prompt]), max_new_tokens=LIMIT,
                                     stop_token_ids=demo["stops"], temperature=temperature, return_stats=True)
        return r.output_ids[0, len(prompt):].tolist(), r.acceptance_lengths

    return generate


def test_dflash2_decoding_equals_the_official_loop_and_the_walk(official, demo, trained2, tmp_path, monkeypatch):
    """Greedy: `speculate` (what launch/speculate.py reports) on a DFlash2 drafter, z-lab's `dflash_generate`
    on its export and the eval walk give the same acceptance length (the issue asks within 3%; here
    equal), and both loops the target's greedy output."""
    drafter, loss = trained2
    generate = official_loop(official, demo, drafter, tmp_path, monkeypatch)
    ours = speculate(demo["hf"], drafter, demo["prompts"], max_new_tokens=LIMIT, stop_ids=demo["stops"],
                     reference=False, progress=False)
    produced = []
    for prompt, out in zip(demo["prompts"], demo["outs"], strict=True):
        tokens, lengths = generate(prompt)
        assert tokens == out  # lossless
        produced.append(lengths)
    theirs = sum(map(sum, produced)) / sum(map(len, produced))
    batch = collate_packed(demo["samples"], range(len(demo["samples"])))
    walked = walk_tau(score(drafter, loss=loss), batch, demo["target"].features(batch), block_size=drafter.block_size,
                      max_turn_tokens=LIMIT, stop_ids=demo["stops"]).metrics()
    assert ours.acceptance_length == pytest.approx(theirs, rel=0.03)
    assert ours.acceptance_length == pytest.approx(walked["tau"]) == pytest.approx(theirs)
    assert ours.turn_forwards == [len(lengths) for lengths in produced]
    assert walked["tau"] > 2 and walked["argmax_tau"] < 1.5  # the selector's path, not the argmax, is decoded


@pytest.mark.slow
def test_dflash2_speculative_sampling_accepts_as_the_official_loop(official, demo, trained2, tmp_path, monkeypatch):
    """At temperature 1, 32 turns each: our sampled decoding and z-lab's `dflash_generate` on the same
    drafter and target accept alike, within 3 standard errors of the difference (both are random: 3% is
    about one standard error here, so a 3% bound would fail by chance; the figures are in the message)."""
    drafter, _ = trained2
    generate = official_loop(official, demo, drafter, tmp_path, monkeypatch)
    prompts = [p for p in demo["prompts"] for _ in range(4)]
    ours = speculate(demo["hf"], drafter, prompts, max_new_tokens=LIMIT, stop_ids=demo["stops"], reference=False,
                     progress=False, sampling=Sampling(1.0), seed=0)
    torch.manual_seed(0)  # dflash_generate draws from torch's global generator
    runs = [generate(p, 1.0)[1] for p in prompts]
    theirs, theirs_err = ratio_and_error(np.asarray([sum(r) for r in runs], dtype=np.float64),
                                         np.asarray([len(r) for r in runs], dtype=np.float64))
    mine, mine_err = ours.acceptance_length, ours.acceptance_length_stderr
    assert abs(mine - theirs) < 3 * np.hypot(mine_err, theirs_err), (mine, mine_err, theirs, theirs_err)
    assert mine > 1.1 and theirs > 1.1  # drafts are accepted at temperature 1


def test_a_prompt_past_the_targets_positions_is_refused_before_the_models_load(demo, tmp_path, capsys,
                                                                                monkeypatch):
    """It used to decode with a negative limit and print NOT LOSSLESS (exit 1): a false alarm about
    the property users trust most. The turns are tokenized and checked before any weight loads."""
    from dflash.demo import TARGET

    from ..conftest import launch_script

    cli = launch_script("speculate")
    make_drafter(demo).save_pretrained(tmp_path / "drafter")
    positions = demo["hf"].config.max_position_embeddings
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "hello"}]}) + "\n"
                       + json.dumps({"messages": [{"role": "user", "content": "hello " * positions}]}) + "\n")
    monkeypatch.setattr("dflash.tools.speculate.load_models",
                        lambda *a: pytest.fail("the models load before the check"))
    with pytest.raises(SystemExit) as e:
        cli.main(["--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts), "--target", str(TARGET),
                  "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {prompts}: turn 1 has a prompt of ") and err.count("\n") == 1, err
    assert f"(1 of 2 turns reach past the target's {positions:,} positions, max_position_embeddings of {TARGET})" in err


def test_prompts_without_target_take_the_drafters_target_or_say_it_is_missing(tmp_path, capsys):
    """A fresh clone's first try: the committed real-benchmark drafter on its held-out prompts without
    --target. The drafter records its target; where that is not here, one line says --target is missing
    and names it (never the demo target's layer-count error)."""
    import shutil

    from dflash.bench_real import ASSETS, HELDOUT, target_gguf
    from dflash.drafter.config_format import TARGET_KEY
    from dflash.tools.speculate import recorded_target

    from ..conftest import launch_script

    cli = launch_script("speculate")
    drafter = shutil.copytree(ASSETS / "drafter", tmp_path / "drafter")
    config = json.loads((drafter / "config.json").read_text())
    assert config[TARGET_KEY]["name"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    # not a path here: the installed wheel's file is found by its content
    assert recorded_target(drafter) == str(target_gguf())
    config[TARGET_KEY].update(name=str(tmp_path / "absent.gguf"), sha256="0" * 64)
    (drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit):
        cli.main(["--drafter", str(drafter), "--prompts", str(HELDOUT)])
    assert capsys.readouterr().err == (f"error: --target is missing: --drafter {drafter} was trained on "
                                       f"{tmp_path / 'absent.gguf'} (llama, 30 layers), which is not here; give its "
                                       "path or Hub id with --target\n")
    del config[TARGET_KEY]  # a drafter of an older dflash, for a target other than the demo's
    (drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit):
        cli.main(["--drafter", str(drafter), "--prompts", str(HELDOUT)])
    err = capsys.readouterr().err
    assert err.startswith(f"error: --target is missing: --drafter {drafter} records no target; it was trained on "
                          "one of 30 layers") and "Traceback" not in err


def test_a_drafter_of_another_target_is_refused_before_any_weight_loads(tmp_path, capsys, monkeypatch):
    from dflash.bench_real import ASSETS, HELDOUT
    from dflash.demo import TARGET

    from ..conftest import launch_script

    cli = launch_script("speculate")

    def no_loading(*_):
        raise AssertionError("weights loaded before the configs were compared")

    monkeypatch.setattr("dflash.tools.speculate.load_models", no_loading)
    with pytest.raises(SystemExit):
        cli.main(["--drafter", str(ASSETS / "drafter"), "--prompts", str(HELDOUT), "--target", str(TARGET)])
    err = capsys.readouterr().err
    assert err.startswith(f"error: --drafter {ASSETS / 'drafter'} does not fit --target {TARGET}: ") and \
        err.count("\n") == 1, err
