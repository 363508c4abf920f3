"""The trainer's eval walk at a temperature on held-out data regenerated greedily (as the demo's are):
tau@1 walks held-out prompts continued by the target at temperature 1, so it predicts
`speculate(..., Sampling(1))` decoding of the same prompts within the standard errors both report,
where the walk along the data's greedy turns reads far too high. The sampled turns are the target's
own samples (transformers' sampling with the same seed), the same at every evaluation, and a new
evaluator of the same run reads them back from eval_turns.json.

In-process on one gloo rank, with the demo target, its greedy turns (`tests/decoding/test_speculate.py`)
and a small drafter fitted to them; the two-rank walk runs in tests/training/test_training.py.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash import testing
from dflash.decoding import speculate as speculate_module
from dflash.decoding.sampling import Sampling
from dflash.decoding.speculate import speculate
from dflash.distributed.run_folder import RunPaths
from dflash.models import BlockLoss, DFlashDrafter, DrafterConfig, slot_weights
from dflash.training.config import TrainConfig
from dflash.training.evaluator import Evaluator, turn_seed
from dflash.training.plan import EvalSettings

from ..demo_turns import LIMIT, fit

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops on shared cores

REPEATS = 4  # each of the demo's 8 held-out turns 4 times: 32 turns, each sampled from its own seed


@pytest.fixture(scope="module")
def one_rank():
    with testing.one_rank():
        yield


@pytest.fixture(scope="module")
def fitted(demo):
    """A drafter of block 4 fitted hard to the demo's greedy turns (every anchor): along them it accepts
    far more than along the target's samples at temperature 1."""
    torch.manual_seed(1)
    config = DrafterConfig.from_target(demo["hf"].config, mask_token_id=demo["mask_id"], block_size=4,
                                       draft_layers=1, target_layer_ids=demo["target"].target_layer_ids,
                                       vocab_size=demo["target"].num_embedding_rows)
    drafter = DFlashDrafter(config, demo["target"].shared_weights(), attention_backend="torch")
    return fit(demo, drafter, steps=150, gamma=4.0)


class Store(list):
    """Held-out samples (ids, loss mask) as the token store serves them."""

    @property
    def lengths(self):
        return np.asarray([len(ids) for ids, _ in self])


def evaluator(demo, drafter, out, *, sample_turns, seed=0):
    """The trainer's Evaluator over the demo's greedy turns (meta.temperature 0, limit LIMIT)."""
    store, B = Store(demo["samples"] * REPEATS), drafter.block_size
    cfg = TrainConfig.of(target="demo", output_dir=str(out), block_size=drafter.block_size, token_budget=4096,
                         seed=seed, eval_temperatures=(0.0, 1.0), eval_sample_turns=sample_turns, progress=False)
    settings = EvalSettings(B, 4096, seed, "demo", partitioned=False, output_dir=out, progress=False)
    maker = SimpleNamespace(store=store, mask_token_id=drafter.config.mask_token_id, weights=slot_weights(B, 4.0))
    data = SimpleNamespace(maker=maker, eval_idx=np.arange(len(store)), turn_limit=LIMIT,
                           stop_ids=demo["stops"], data_temperature=0.0)
    models = SimpleNamespace(target=SimpleNamespace(model=demo["target"], hf=demo["hf"]), engine=drafter,
                             drafter=drafter, loss=BlockLoss(), eval_loss=BlockLoss())
    return Evaluator(cfg.eval, settings, data, models, torch.device("cpu"), torch.float32)


def test_tau_at_1_predicts_decoding_at_1_on_greedy_data(one_rank, demo, fitted, tmp_path):
    record = evaluator(demo, fitted, tmp_path / "run", sample_turns=100).walk()
    on_data = evaluator(demo, fitted, tmp_path / "old", sample_turns=0).walk()
    decoded = speculate(demo["hf"], fitted, demo["prompts"] * REPEATS, max_new_tokens=LIMIT, stop_ids=demo["stops"],
                        reference=False, progress=False, sampling=Sampling(1.0), seed=12).summary()
    measured, measured_err = decoded["acceptance_length"], decoded["acceptance_length_stderr"]
    assert record["tau@1_stderr"] > 0 and on_data["tau@1_stderr"] > 0
    error = np.hypot(record["tau@1_stderr"], measured_err)
    assert abs(record["tau@1"] - measured) < 3 * error, (record["tau@1"], measured, error)
    # along the greedy turns the drafter was fitted to, tau@1 overstates decoding at 1 by far:
    # the comparison above can fail
    assert on_data["tau@1"] - measured > 3 * np.hypot(on_data["tau@1_stderr"], measured_err), (on_data, measured)
    assert measured > 1.05  # drafts are accepted at temperature 1
    # greedy tau still walks the data's turns
    assert record["tau"] == on_data["tau"] and record["turns"] == on_data["turns"] == 8 * REPEATS


def test_sampled_turns_are_the_targets_samples_kept_for_the_run(one_rank, demo, fitted, tmp_path,
                                                                monkeypatch):
    ev = evaluator(demo, fitted, tmp_path, sample_turns=5)
    first = ev.walk()
    turns = ev.sampled_turns(1.0)
    assert len(turns) == 5
    # transformers' own sampling at temperature 1 with each turn's seed draws the same tokens
    hf, prompts = demo["hf"], demo["prompts"]
    for k, (ids, mask) in enumerate(turns):
        prompt = prompts[k % len(prompts)]
        assert ids[:len(prompt)].tolist() == prompt and not mask[:len(prompt)].any() and mask[len(prompt):].all()
        torch.manual_seed(turn_seed(0, 1.0, k))
        generated = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=LIMIT,
                                eos_token_id=list(demo["stops"]), pad_token_id=demo["tok"].pad_token_id)
        assert ids[len(prompt):].tolist() == generated[0, len(prompt):].tolist()
    assert any(len(ids) - mask.argmax() < LIMIT for ids, mask in turns)  # some stop early: stop ids as decoding's

    def no_sampling(*args, **kwargs):
        raise AssertionError("the held-out turns were sampled again")

    monkeypatch.setattr(speculate_module, "sample_turns", no_sampling)
    assert ev.walk() == first  # the same turns at every evaluation
    saved = json.loads(RunPaths(tmp_path).eval_turns.read_text())
    assert saved["fingerprint"]["turns"] == 5 and len(saved["turns"]["1"]) == 5
    assert evaluator(demo, fitted, tmp_path, sample_turns=5).walk() == first  # a resumed run reads them back
    monkeypatch.undo()
    other = evaluator(demo, fitted, tmp_path, sample_turns=5, seed=1)  # other turns: sampled again
    assert [t[0].tolist() for t in other.sampled_turns(1.0)] != [t[0].tolist() for t in turns]
