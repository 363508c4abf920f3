"""What lets a user benchmark before downloading anything: random targets (`--target random:...`),
synthetic data, the same random subset for every mode (`--subset-tokens`), and phase timing."""
import numpy as np
import pytest
import torch

from dflash.data.planner import PlannerConfig, plan_batches
from dflash.data.seed_lengths import seed_like_lengths
from dflash.errors import UserError
from dflash.target.spec import PRESETS, load_target_spec
from dflash.training.config import load_config
from dflash.training.data import token_subset
from dflash.training.phases import PHASES, PhaseTimer

from ..conftest import ROOT

DEMO_TARGET = ROOT / "dflash" / "demo" / "assets" / "target"


def test_the_qwen3_8b_preset_builds_the_real_model_shape():
    from transformers import AutoModelForCausalLM

    config = load_target_spec("random:qwen3-8b").config
    assert config.model_type == "qwen3"
    assert {k: getattr(config, k) for k in PRESETS["qwen3-8b"]} == PRESETS["qwen3-8b"]
    with torch.device("meta"):  # sizes only: no memory
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == 8_190_735_360  # Qwen3-8B
    by_path = load_target_spec(f"random:{DEMO_TARGET}").config
    assert (by_path.hidden_size, by_path.num_hidden_layers, by_path.vocab_size) == (128, 6, 512)
    with pytest.raises(UserError, match=r"random:PRESET \(qwen3-8b, .*\) or random:PATH"):
        load_target_spec("random:no-such-model")


def test_a_random_target_defaults_to_synthetic_data_and_refuses_text():
    cfg = load_config(["--target", "random:qwen3-8b"])
    assert (cfg.inputs.data, cfg.run.output_dir, cfg.eval.speculate_turns) == ("random", "runs/random", 0)
    cfg = load_config(["--target", "random:qwen3-8b", "--data", "random:500", "--speculate-turns", "3"])
    assert (cfg.inputs.data, cfg.eval.speculate_turns) == ("random:500", 3)
    with pytest.raises(UserError, match="--data: --target random:qwen3-8b has random weights"):
        load_config(["--target", "random:qwen3-8b", "--data", "conversations.jsonl"])
    with pytest.raises(UserError, match=r"--data random:0: expected random or random:SAMPLES"):
        load_config(["--data", "random:0"])
    with pytest.raises(UserError, match="random:PRESET"):
        load_config(["--target", "random:llama-9000"])
    assert load_target_spec("random:qwen3-8b").generation_eos() is None  # no folder: the tokenizer's eos ends turns


def test_a_random_target_runs_features_on_synthetic_data():
    from dflash.data.collate import collate_packed
    from dflash.data.synthetic import synthetic_store
    from dflash.training.target import load_target

    target = load_target(load_target_spec(f"random:{DEMO_TARGET}"), "cpu", torch.float32, num_features=2)
    assert target.mask_id == len(target.tokenizer) - 1 < target.model.num_embedding_rows
    store = synthetic_store("random:20", target.tokenizer, seed=0, max_length=64)
    batch = collate_packed(store, [0, 1, 2])
    assert target.model.features(batch).shape == (batch.num_tokens, 2 * 128)


def test_every_mode_gets_the_same_subset_whatever_its_order():
    lengths = seed_like_lengths(5000, seed=1).astype(np.int64)
    split = np.sort(np.random.default_rng(0).permutation(5000)[:4500])
    subset = token_subset(split, lengths, 100_000, seed=0)
    assert np.all(np.diff(subset) > 0) and np.isin(subset, split).all()
    # the fewest samples of a seeded random order that reach the tokens
    assert lengths[subset].sum() >= 100_000 > lengths[subset].sum() - lengths[subset].max()
    assert np.array_equal(subset, token_subset(split, lengths, 100_000, seed=0))
    assert not np.array_equal(subset, token_subset(split, lengths, 100_000, seed=1))
    assert np.array_equal(token_subset(split, lengths, 10**12, seed=0), split)
    # planned by each mode, every order holds exactly these samples
    for order in ("sorted", "shuffle", "bucketed"):
        plan = plan_batches(lengths[subset], PlannerConfig(16384, order, "packed"))
        assert sorted(np.concatenate(plan[0]).tolist()) == list(range(subset.size))


def test_phase_marks_book_each_span_to_its_phase_only_while_a_step_is_timed(monkeypatch):
    class Drafter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.Identity()

        def forward(self, x):
            return self.norm(x)

    drafter = Drafter()
    timer = PhaseTimer(torch.device("cpu"), drafter)
    clock = iter([0.0, 1.0, 3.0, 6.0, 10.0, 15.0, 21.0])
    monkeypatch.setattr("dflash.training.phases.time.perf_counter", lambda: next(clock))
    drafter(torch.zeros(1))  # not started: no marks (an eval walk, decoding)
    timer.start()  # 0
    timer.mark("target_forward")  # 1
    drafter(torch.zeros(1))  # norm hook: drafter_forward at 3
    timer.mark("loss")  # 6: the trainer's mark after the loss
    timer.mark("drafter_backward")  # 10
    timer.mark("other")  # 15
    timer.mark("optimizer")  # 21
    assert timer.seconds() == {"target_forward": 1.0, "drafter_forward": 2.0, "loss": 3.0, "drafter_backward": 4.0,
                               "optimizer": 6.0, "other": 5.0}
    assert tuple(timer.seconds()) == PHASES and sum(timer.seconds().values()) == 0  # read once
    timer.close()
    drafter(torch.zeros(1))
    assert timer._marks is None
