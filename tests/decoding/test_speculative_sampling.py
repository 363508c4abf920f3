"""Speculative sampling is lossless in distribution: its outputs follow the law of the target's own sampling.

A tiny random Qwen3 target (4 tokens, logits of order 1, so distributions are spread) and a random
DFlash drafter of block 3 (2 drafted slots, so acceptance, rejection with the residual, and the bonus
token after a full block all occur within 4 generated tokens). The first 4 tokens after a fixed
prompt have 4^4 = 256 possible values; their exact probabilities under the target's own sampling
(temperature, top-p) come from one batched forward over all of them. N runs of
`speculative_decode` are compared with that law by a chi-square goodness-of-fit test (bins of
expected count < 5 pooled): the test fails when p < ALPHA = 1e-3, so a correct sampler fails it
with probability 1e-3 over the choice of seeds (the seeds here are fixed, so the outcome is too).
Power: the same test on a deliberately wrong rule (rejected slots resampled from p instead of
max(0, p - q)) gives p ~ 1e-15 with the same N (1e-10 with another seed); it must be < 1e-8. The
negative controls run fewer outputs where their mistake shows that far below 1e-8 (a test that
detects it with N / 2 outputs detects it with N): the wrong residual p ~ 1e-11 with 300.

Every drafter kind's output is held to the target's law by this test in tests/drafter/test_kind_conformance.py.
A DFlash2 drafter (`tiny2`: its selector keeps K = 2 of the 4 tokens, so q is 0 outside the candidates
and the residual carries the rest) drafts along its selector's path, each slot's q over its candidates
given the drafts before it; the test detects the mistake of verifying those drafts with the backbone's
own softmax instead of the selector's q (p ~ 1e-38 with N, 1e-13 with the 300 it runs).
"""
from __future__ import annotations

import collections
import itertools

import pytest
import torch
from transformers import Qwen3ForCausalLM

from dflash.decoding import sampling as sampling_module
from dflash.decoding import speculate as speculate_module
from dflash.decoding.sampling import Sampler, Sampling, target_probs, top_p_filter, verify_block
from dflash.decoding.speculate import greedy_decode, speculative_decode
from dflash.drafter.kinds.dflash2 import DFlash2Drafter, DFlash2Settings
from dflash.models import DFlashDrafter, DrafterConfig, SharedWeights
from dflash.testing import tiny_qwen3_config

VOCAB, PROMPT, LENGTH, RUNS, ALPHA = 4, [1, 2, 0], 4, 600, 1e-3


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = tiny_qwen3_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(16.0)  # logits of order 1: spread distributions, about 17 likely outcomes
    dconfig = DrafterConfig.from_target(config, mask_token_id=VOCAB - 1, block_size=3, draft_layers=1,
                                        target_layer_ids=[0])
    drafter = DFlashDrafter(dconfig, SharedWeights(hf.get_input_embeddings().weight, hf.lm_head.weight),
                            attention_backend="torch").eval()
    return hf, drafter


@pytest.fixture(scope="module")
def tiny2(tiny):
    """A random DFlash2 drafter on the same target: selector top-2 of the 4 tokens, every part away from
    its identity start (its transitions matter)."""
    hf, _ = tiny
    config = DrafterConfig.from_target(hf.config, mask_token_id=VOCAB - 1, block_size=3, draft_layers=1,
                                       target_layer_ids=[0], kind="dflash2", kind_settings=DFlash2Settings(
                                           conv_kernel_size=2, conv_group_size=16, selector_rank=4, selector_top_k=2))
    drafter2 = DFlash2Drafter(config, SharedWeights(hf.get_input_embeddings().weight, hf.lm_head.weight),
                              attention_backend="torch").eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in drafter2.named_parameters():
            if "conv" in name or "selector" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "conv" in name else 1.5))
    return hf, drafter2


def exact_law(hf, sampling: Sampling) -> dict:
    """P(first LENGTH tokens = x) under the target's own sampling, for every x."""
    outcomes = list(itertools.product(range(VOCAB), repeat=LENGTH))
    ids = torch.tensor([PROMPT + list(x) for x in outcomes])
    with torch.no_grad():
        p = target_probs(hf(input_ids=ids).logits, sampling).double()
    rows = torch.arange(len(outcomes))
    law = torch.ones(len(outcomes), dtype=torch.float64)
    for i in range(LENGTH):
        law *= p[rows, len(PROMPT) - 1 + i, ids[:, len(PROMPT) + i]]
    return dict(zip(outcomes, law.tolist(), strict=True))


def chi_square_p_value(outputs: list[tuple], law: dict) -> float:
    """Goodness of fit of the observed outputs to the law; bins expected below 5 are pooled into one."""
    counts = collections.Counter(outputs)
    n = len(outputs)
    big = [x for x, p in law.items() if p * n >= 5]
    observed = [counts[x] for x in big] + [n - sum(counts[x] for x in big)]
    expected = [law[x] * n for x in big] + [n - sum(law[x] * n for x in big)]
    if expected[-1] < 1e-9:  # nothing left to pool
        observed, expected = observed[:-1], expected[:-1]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def outputs(decode, sampler: Sampler, runs: int = RUNS) -> list[tuple]:
    return [tuple(decode(PROMPT, max_new_tokens=LENGTH, stop_ids=[], sampler=sampler).tokens) for _ in range(runs)]


def test_the_target_alone_samples_its_law(tiny):
    """The reference: the target's own sampling follows the law computed here."""
    hf, _ = tiny
    sampling = Sampling(1.0)
    got = outputs(lambda *a, **k: greedy_decode(hf, *a, **k), Sampler(sampling, seed=1))
    assert chi_square_p_value(got, exact_law(hf, sampling)) > ALPHA


def decode_and_count(hf, drafter, monkeypatch, sampling, seed):
    """Speculative decoding's outputs, checked against the exact law (chi-square), with every
    verify branch taken at least 5 times (a rejection at each slot and full blocks with their bonus
    token; argmax drafts never fill a block here); returns the drafts' q of every verified block."""
    accepted, proposals = collections.Counter(), []

    def counting(drafts, q, p, generator=None):
        result = verify_block(drafts, q, p, generator)
        accepted[result[0]] += 1
        proposals.append(q)
        return result

    monkeypatch.setattr(sampling_module, "verify_block", counting)
    got = outputs(lambda *a, **k: speculative_decode(hf, drafter, *a, **k), Sampler(sampling, seed=seed))
    assert chi_square_p_value(got, exact_law(hf, sampling)) > ALPHA
    branches = range(drafter.block_size) if sampling.drafts == "sampled" else range(drafter.block_size - 1)
    assert min(accepted[k] for k in branches) >= 5, accepted
    return proposals


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(1.0, top_p=0.9, drafts="argmax")], ids=str)
def test_speculative_sampling_is_lossless_in_distribution(tiny, monkeypatch, sampling):
    decode_and_count(*tiny, monkeypatch, sampling, seed=2)


def outputs_verified_with_the_backbones_softmax(hf, drafter, monkeypatch, seed: int, runs: int = RUNS) -> list:
    """`runs` sampled outputs (T = 1) of a drafter that chooses its drafts (`propose`), verified as if they were
    drawn from the backbone's unary softmax at T (the DFlash rule): a q other than the one that drew them."""
    sampling = Sampling(1.0)

    def backbone_q(drafter, sampler, cache, features, anchor):
        hidden = drafter.draft_hidden(cache, features, anchor)
        path, _, _ = drafter.propose(hidden, anchor, sampling.temperature, sampler.generator)
        return path.tolist(), torch.softmax(drafter.logits(hidden) / sampling.temperature, dim=-1)

    monkeypatch.setattr(speculate_module, "draft_block", backbone_q)
    return outputs(lambda *a, **k: speculative_decode(hf, drafter, *a, **k), Sampler(sampling, seed=seed), runs)


def test_the_test_detects_dflash2_drafts_verified_with_the_backbones_softmax(tiny2, monkeypatch):
    """The selector's drafts verified with the backbone's softmax: the output leaves the target's law."""
    hf, drafter = tiny2
    got = outputs_verified_with_the_backbones_softmax(hf, drafter, monkeypatch, seed=4, runs=RUNS // 2)
    assert chi_square_p_value(got, exact_law(hf, Sampling(1.0))) < 1e-8


def wrong_verify_block(drafts, q, p, generator=None):
    """The ratio test with a classic mistake: a rejected slot resampled from p, not max(0, p - q)."""
    k = drafts.shape[0]
    rows = torch.arange(k)
    u = torch.rand(k, generator=generator, dtype=torch.float64)
    accepted = int((u * q[rows, drafts].double() < p[rows, drafts].double()).long().cumprod(dim=0).sum())
    return accepted, int(torch.multinomial(p[accepted], 1, generator=generator))


def test_the_test_detects_a_wrong_residual(tiny, monkeypatch):
    hf, drafter = tiny
    sampling = Sampling(1.0)
    monkeypatch.setattr(sampling_module, "verify_block", wrong_verify_block)
    got = outputs(lambda *a, **k: speculative_decode(hf, drafter, *a, **k), Sampler(sampling, seed=2), RUNS // 2)
    assert chi_square_p_value(got, exact_law(hf, sampling)) < 1e-8


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    torch.testing.assert_close(top_p_filter(probs, 0.8), torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    torch.testing.assert_close(top_p_filter(probs, 0.81), torch.tensor([[0.0, 0.5, 0.15, 0.3]]) / 0.95)
    torch.testing.assert_close(top_p_filter(probs, 0.01), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))  # the top one stays
    assert top_p_filter(probs, 1.0) is probs


def test_verify_block_accepts_what_the_target_would_draw():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 6, generator=g), dim=-1)
    drafts = torch.tensor([2, 0, 5])
    # drafts from the target's own distributions are always accepted (u q < p with q = p), then the bonus
    assert verify_block(drafts, p[:3], p, g)[0] == 3
    # a draft the target rules out is always rejected, and the token after it is never that draft
    p0 = p.clone()
    p0[0, 2] = 0
    p0[0] /= p0[0].sum()
    for _ in range(20):
        accepted, token = verify_block(drafts, p[:3], p0, g)
        assert accepted == 0 and token != 2


def test_sampling_options_are_checked():
    with pytest.raises(ValueError, match="temperature"):
        Sampling(-1.0)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(1.0, top_p=0.0)
    with pytest.raises(ValueError, match="drafts"):
        Sampling(1.0, drafts="beam")
    assert Sampling().greedy and not Sampling(0.5).greedy
