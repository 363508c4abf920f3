"""Regeneration through vLLM (`--backend vllm`, one engine for the module) against the Hugging Face
backend on the demo target: greedy, the same answers; sampled, the engine's tokens drawn from the target's
own distribution (a chi-square test that rejects the distribution at another temperature)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (bash launch/install.sh serve; CI installs it)")

from dflash.demo import PROMPTS, TARGET  # noqa: E402
from dflash.regenerate import HFBackend, RegenerateConfig, load_tokenizer, regenerate  # noqa: E402
from dflash.regenerate.engines import VLLMBackend  # noqa: E402
from dflash.target.spec import load_target_spec  # noqa: E402

from ..conftest import read_jsonl  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(TARGET))


@pytest.fixture(scope="module")
def backends(tokenizer):
    spec = load_target_spec(str(TARGET))
    return HFBackend(spec, tokenizer, "auto"), VLLMBackend(spec, tokenizer, "auto", None)


def run(tmp_path, backend, name, prompts, **kw):
    cfg = RegenerateConfig(target=str(TARGET), input=str(prompts), output=str(tmp_path / name), max_new_tokens=40,
                           batch_size=4, backend=backend.name, **kw)
    regenerate(cfg, backend=backend, progress=False)
    return [row["messages"] for row in read_jsonl(tmp_path / name)]


def test_greedy_answers_equal_hf(tmp_path, backends):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(PROMPTS.read_text(encoding="utf-8").splitlines()[:6]) + "\n", encoding="utf-8")
    hf, vllm = backends
    ours = run(tmp_path, hf, "hf.jsonl", prompts)
    theirs = run(tmp_path, vllm, "vllm.jsonl", prompts)
    assert any(m["role"] == "assistant" and m["content"] for c in ours for m in c)
    assert theirs == ours


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of the counts under `probs`, the tokens of expected count < 5 pooled into one cell."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = torch.tensor(float(keep.sum() - 1), dtype=stat.dtype)
    return float(torch.special.gammaincc(dof / 2, stat / 2))  # the chi-square survival function


def test_sampled_tokens_follow_the_targets_distribution(tokenizer, backends):
    """600 first tokens of one prompt sampled at temperature 1 (one seed each) against the target's
    softmax (fp32): not rejected; against its softmax at temperature 0.7: rejected."""
    hf, vllm = backends
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me something."}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = 600
    # the engine's turns, the stop token kept (the backend cuts it from its answers)
    outs = vllm.engine.generate([prompt] * n, max_new_tokens=1, stop_ids=vllm.stops, temperature=1.0,
                                seeds=list(range(n)))
    with torch.no_grad():
        logits = hf.model(torch.tensor([prompt])).logits[0, -1].double()
    counts = torch.zeros_like(logits)
    for o in outs:
        counts[o.tokens[0]] += 1
    assert chi_square_p(counts, logits.softmax(-1)) > 1e-3
    assert chi_square_p(counts, (logits / 0.7).softmax(-1)) < 1e-3
    again = vllm.generate([prompt] * 3, max_new_tokens=8, temperature=1.0, seeds=[5, 5, 6])
    assert again[0] == again[1]  # a turn's seed decides it
