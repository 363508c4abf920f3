"""launch/regenerate.py's Hugging Face backend on every target family: batched, left-padded
generation gives each turn the target's greedy answer to its own history."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from dflash.demo import PROMPTS, TARGET
from dflash.demo.families import CONFIGS
from dflash.regenerate import HFBackend, RegenerateConfig, load_tokenizer, regenerate, strip_thinking
from dflash.target.spec import load_target_spec

from ..conftest import greedy_reference, read_jsonl


@pytest.mark.parametrize("family", [f for f in CONFIGS if f != "qwen3"])
def test_regenerated_turns_are_greedy_answers(family, tmp_path):
    from transformers import AutoModelForCausalLM

    demo = json.loads((TARGET / "config.json").read_text())
    config = CONFIGS[family]()
    config.vocab_size, config.eos_token_id, config.pad_token_id = demo["vocab_size"], demo["eos_token_id"], 0
    torch.manual_seed(0)
    folder = tmp_path / family
    AutoModelForCausalLM.from_config(config).float().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TARGET / name, folder / name)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    multi = [r for r in rows if sum(m["role"] == "assistant" for m in r["messages"]) >= 2][:1]
    short = sorted((r for r in rows if r["messages"][-1]["role"] == "user"), key=lambda r: len(str(r)))[:2]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in multi + short))  # prompts of unequal length
    tokenizer = load_tokenizer(str(folder))
    backend = HFBackend(load_target_spec(str(folder)), tokenizer, "float32")
    cfg = RegenerateConfig(target=str(folder), input=str(prompts), output=str(tmp_path / "out.jsonl"),
                           max_new_tokens=8, batch_size=3)
    regenerate(cfg, backend=backend, tokenizer=tokenizer, progress=False)
    out = read_jsonl(Path(cfg.output))
    answers = [m["content"] for r in out for m in r["messages"] if m["role"] == "assistant"]
    assert len(out) == 3 and sum(bool(a) for a in answers) >= 2  # not a comparison of empty turns
    for row in out:
        got = row["messages"]
        for i, m in enumerate(got):
            if m["role"] == "assistant":
                assert m["content"] == strip_thinking(greedy_reference(backend.model, tokenizer, got[:i], 8))
