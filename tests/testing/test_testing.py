"""The tests' own helpers in the package (`dflash.testing`)."""
import os

import torch
from transformers import Qwen3ForCausalLM

from dflash.testing import launcher_env, tiny_qwen3_config


def test_the_tiny_target_builds_with_its_sizes_and_any_overridden():
    config = tiny_qwen3_config(num_hidden_layers=2)
    model = Qwen3ForCausalLM(config)
    assert len(model.model.layers) == 2 and model.config.vocab_size == 256 and model.config.hidden_size == 64
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 256) and torch.isfinite(logits).all()


def test_the_launcher_environment_lasts_only_its_block(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    with launcher_env():
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "1") and int(os.environ["MASTER_PORT"]) > 0
    assert dict(os.environ) == before
