"""The bundled demo: a loadable Qwen3 target with the shapes the drafter needs, a prefix-stable chat
template, prompts the build script re-creates, and a dataset that this target really produced."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from dflash.demo import ASSETS, DATA, PROMPTS, TARGET, paths
from dflash.demo.build import make_prompts, render
from dflash.regenerate import RegenerateConfig, load_tokenizer, regenerate

BUILD_SEED, BUILD_BATCH, BUILD_MAX_NEW = 0, 16, 256  # launch/build_demo.py defaults


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(TARGET))


@pytest.fixture(scope="module")
def data():
    return [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def prompts():
    return [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]


def test_paths_point_at_the_bundled_files():
    assert paths() == {"target": TARGET, "prompts": PROMPTS, "data": DATA}
    assert all(p.exists() for p in paths().values())
    size = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    assert size < 8 * 2**20, f"demo assets are {size / 2**20:.1f} MiB; keep them a few MB"


def test_target_is_a_small_qwen3_with_drafter_friendly_shapes(tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32)
    c = model.config
    assert c.model_type == "qwen3"
    assert c.head_dim == 64 and c.num_attention_heads > c.num_key_value_heads  # GQA, kernel head dim
    assert c.num_hidden_layers >= 6 and c.max_position_embeddings >= 1024
    assert c.vocab_size % 64 == 0 and c.vocab_size > len(tokenizer)  # a spare row for <|MASK|>
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
    assert tokenizer.is_fast and tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None


def test_chat_template_is_chatml_and_prefix_stable(tokenizer, data):
    for row in data[:50]:
        msgs = row["messages"]
        assert tokenizer.apply_chat_template(msgs, tokenize=False) == render(msgs)
        for i in (i for i, m in enumerate(msgs) if m["role"] == "assistant"):
            head = tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
            assert tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False).startswith(head)


def test_tokenizer_round_trips_the_demo_text_without_unknowns(tokenizer, data):
    for row in data[:200]:
        text = render(row["messages"])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text


def test_prompts_are_what_the_build_script_generates(prompts):
    assert prompts == make_prompts(len(prompts), BUILD_SEED + 1)
    assert any(p["messages"][-1]["role"] == "user" for p in prompts)  # prompt-only
    assert any(sum(m["role"] == "assistant" for m in p["messages"]) >= 2 for p in prompts)  # multi-turn
    assert any(p["messages"][0]["role"] == "system" for p in prompts)


def test_demo_data_regenerates_every_prompt_in_order(prompts, data):
    assert len(data) == len(prompts) >= 1000
    for i, (p, d) in enumerate(zip(prompts, data, strict=True)):
        assert d["meta"]["source_line"] == i + 1
        assert d["meta"]["temperature"] == 0.0 and d["meta"]["keep_thinking"] is True
        src = p["messages"]
        assert [m for m in d["messages"] if m["role"] != "assistant"] == [m for m in src if m["role"] != "assistant"]
        assert d["messages"][-1]["role"] == "assistant"


def test_demo_responses_are_structured_and_varied(tokenizer, data):
    responses = [m["content"] for d in data for m in d["messages"] if m["role"] == "assistant"]
    lengths = [len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in responses]
    # the briefly trained target still loops on some prompts (20% of the bundled set hit the limit)
    assert sum(d["meta"]["hit_limit"] for d in data) < 0.3 * len(data)
    assert max(lengths) >= 100 and min(lengths) <= 10  # variable lengths for the batching code
    assert len(set(responses)) > 0.4 * len(responses)  # not one canned answer
    # degenerate = one word makes up most of a longer answer (a loop such as ". . . .")
    degenerate = [r for r, n in zip(responses, lengths, strict=True)
                  if n >= 8 and Counter(r.split()).most_common(1)[0][1] > 0.6 * n]
    assert len(degenerate) < 0.05 * len(responses), degenerate[:3]


def test_first_batch_of_demo_data_is_reproduced_by_regenerate(tmp_path, data):
    cfg = RegenerateConfig(
        target=str(TARGET), input=str(PROMPTS), output=str(tmp_path / "again.jsonl"),
        max_new_tokens=BUILD_MAX_NEW, batch_size=BUILD_BATCH, keep_thinking=True, backend="hf",
        target_name="dflash-demo-target", dtype="float32", limit=BUILD_BATCH,
    )
    regenerate(cfg, progress=False)
    again = [json.loads(line) for line in Path(cfg.output).read_text(encoding="utf-8").splitlines()]
    assert {a["meta"].pop("source") for a in again} == {str(PROMPTS.resolve())}  # newer than the bundled data
    for a in again:  # the target's content hash, which regeneration records since (its resume checks it)
        assert len(a["meta"].pop("target_sha256")) == 64
    # Greedy decoding is exact on one machine; another CPU's float rounding may flip a rare
    # near-tie argmax, so allow one conversation in the batch to differ.
    same = sum(a == b for a, b in zip(again, data[:BUILD_BATCH], strict=True))
    assert len(again) == BUILD_BATCH and same >= BUILD_BATCH - 1
