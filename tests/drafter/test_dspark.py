"""The DSpark drafter: its Markov head and sequential sampling against a plain walk, the anchor-as-first-
prediction layout (training rows = decoding's query rows), its objective against a dense autograd
reference, its export against vLLM 0.32's `Qwen3DSparkForCausalLM` names and keys with a strict reload, and
that the chi-square test catches drafts verified without the Markov bias. What every kind must do
(decoding equal to training, lossless greedy, sampling in the target's law, the memory plan and the
FLOPs as measured) is tests/drafter/test_kind_conformance.py's."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dflash.decoding.sampling import Sampling
from dflash.drafter.kinds import drafter_kind
from dflash.drafter.kinds.dspark import DSparkDrafter, DSparkSettings, row_flops
from dflash.models import Anchors, BlockLoss, DFlashDrafter, DrafterConfig, SharedWeights
from dflash.objective.blocks import Blocks
from dflash.objective.terms import target_context

from ..decoding.test_speculative_sampling import tiny  # noqa: F401 - the fixture
from .drafter_helpers import MASK_ID, TAPS, B, make_batch, tiny_target

SETTINGS = DSparkSettings(markov_rank=8)


def tiny_config(target, settings=SETTINGS, block_size=B):
    return DrafterConfig.from_target(target.config, mask_token_id=MASK_ID, block_size=block_size, draft_layers=2,
                                     target_layer_ids=TAPS, kind="dspark", kind_settings=settings)


def tiny_dspark(target, seed=0, settings=SETTINGS, markov=0.5):
    """Every parameter random; the Markov head strong enough to change the argmax."""
    drafter = DSparkDrafter(tiny_config(target, settings), target.shared_weights(), attention_backend="torch")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else (markov if "markov" in name else 0.15) * torch.randn(p.shape, generator=g))
    return drafter


def test_the_sequential_stage_is_a_plain_markov_walk_greedy_and_sampled():
    """propose: row k's logits are lm_head(h_k) + W2 W1[prev], prev the anchor then the previous draft,
    greedy the argmax, sampled a draw from softmax(/T) returned as q."""
    target = tiny_target(1)
    drafter = tiny_dspark(target, seed=1)
    W1 = drafter.markov_head.markov_w1.weight.detach()
    W2 = drafter.markov_head.markov_w2.weight.detach()
    hidden = torch.randn(B - 1, 64, generator=torch.Generator().manual_seed(2))
    base = hidden @ target.shared_weights().lm_head.t()
    path, vocab, q = drafter.propose(hidden, 7)
    assert q is None and vocab.shape == (B - 1, 300)
    prev = 7
    for k in range(B - 1):
        logits = base[k] + W2 @ W1[prev]
        assert int(path[k]) == int(logits.argmax())
        prev = int(path[k])
    # the bias changes some draft: the head is not a no-op here
    assert path.tolist() != base.argmax(-1).tolist()
    path, _, q = drafter.propose(hidden, 7, 0.8, torch.Generator().manual_seed(3))
    prev = 7
    for k in range(B - 1):
        torch.testing.assert_close(q[k], torch.softmax((base[k] + W2 @ W1[prev]) / 0.8, -1))
        prev = int(path[k])


def test_the_anchor_is_the_first_prediction_its_rows_are_a_dflash_backbones_block_of_b_minus_1():
    """A block of B has B - 1 query rows [anchor, mask x (B-2)] at positions a .. a+B-2: the training
    forward's row k >= 1 is the DFlash backbone's row k - 1 of a block of B - 1 at the same anchor (which
    predicts the token at a + k); row 0 is zeros. (That decoding drafts from these rows is the conformance
    suite's `test_decoding_block_by_block_equals_the_packed_training_forward`.)"""
    target = tiny_target(3)
    drafter = tiny_dspark(target, seed=3)
    lengths = [9, 14]
    batch = make_batch(lengths, seed=3)
    feats = target.features(batch)
    seq = [s for s, n in enumerate(lengths) for _ in range(n)]
    anchor = [a for n in lengths for a in range(n)]
    anchors = Anchors(torch.tensor(seq, dtype=torch.int32), torch.tensor(anchor, dtype=torch.int32), B, 0)
    blocks = Blocks.build(anchors, batch, MASK_ID, torch.ones(B - 1))
    plain = DFlashDrafter(drafter.config, target.shared_weights(), attention_backend="torch")
    plain.load_state_dict({k: v for k, v in drafter.state_dict().items() if "head" not in k})
    short = Blocks.build(Anchors(anchors.block_seq, anchors.block_anchor, B - 1, 0), batch, MASK_ID, torch.ones(B - 2))
    with torch.no_grad():
        training = drafter(batch, feats, blocks).view(-1, B, 64)
        backbone = plain(batch, feats, short).view(-1, B - 1, 64)
    assert not training[:, 0].any()
    torch.testing.assert_close(training[:, 1:], backbone)


def dense_objective(drafter, hidden, blocks, states, ce=1.0, w_ce=0.1, w_tv=0.9, w_conf=1.0):
    """The DSpark objective written out with autograd over whole vocabulary rows."""
    lm_head = drafter.lm_head
    B = blocks.block_size
    h = hidden.view(-1, B, hidden.shape[-1])[:, 1:].reshape(-1, hidden.shape[-1])
    labels, w = blocks.labels.reshape(-1), blocks.weights.reshape(-1)
    anchors = blocks.input_ids.view(-1, B)[:, :1]
    prev = torch.cat([anchors, blocks.labels[:, :-1]], 1).reshape(-1)
    base = h @ lm_head.t()
    e = drafter.markov_head.markov_w1.weight[prev]
    z = base + e @ drafter.markov_head.markov_w2.weight.t()
    a = blocks.anchors
    start = blocks.position_ids.view(-1, B)[:, 0]  # anchors' in-sample positions
    offsets = torch.tensor([0, *states["cu"][1:]])[a.block_seq.long()]
    positions = (offsets + start)[:, None] + torch.arange(B - 1)[None]
    p = torch.softmax(states["states"][positions.reshape(-1)] @ lm_head.t(), -1)
    q = torch.softmax(z, -1)
    tv = 0.5 * (q - p).abs().sum(-1)
    loss = ce * (w * F.cross_entropy(base, labels, reduction="none")).sum()
    loss = loss + (w * (w_ce * F.cross_entropy(z, labels, reduction="none") + w_tv * tv)).sum()
    conf = drafter.confidence_head(h.detach(), e.detach())
    bce = F.binary_cross_entropy_with_logits(conf, (1 - tv).detach(), reduction="none")
    return loss + w_conf * (w * bce).sum()


def test_the_markov_and_confidence_terms_are_the_dense_objective_with_its_gradients():
    target = tiny_target(5)
    drafter = tiny_dspark(target, seed=5).double()
    target.model.double()
    batch = make_batch([20, 25], seed=5)
    feats, states = target.features(batch, with_output=True)
    feats, states = feats.double(), states.double()
    from dflash.models import draw_blocks, slot_weights

    blocks = draw_blocks(batch, block_size=B, num_anchors=5, mask_token_id=MASK_ID,
                         slot_weights=slot_weights(B, 4.0), seed=0, epoch=0)
    kind = drafter_kind("dspark")
    loss = BlockLoss(chunk_rows=5, terms=kind.terms(drafter, SimpleNamespace()))
    drafter.zero_grad()
    out = loss(drafter(batch, feats, blocks), blocks, drafter.lm_head, context=target_context(states, batch))
    out.loss_sum.backward()
    got = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    ref = dense_objective(drafter, drafter(batch, feats, blocks), blocks,
                          {"states": states, "cu": batch.cu_seqlens.tolist()})
    ref.backward()
    torch.testing.assert_close(out.loss_sum.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)
    assert set(out.parts) == {"ce", "markov", "confidence"}
    # the walk reads the Markov path: its teacher-forced argmax, and the backbone's beside it
    assert "argmax_tau_sum" in out.metrics
    figures = loss.figures({k: v for k, v in out.metrics.items()}, out.num_blocks)
    assert 0 <= figures["markov_tv"] <= 1 and 0 <= figures["confidence_mean"] <= 1
    # the walk at temperature reads the Markov path's q of each label (teacher forced)
    with torch.no_grad():
        hidden = drafter(batch, feats, blocks)
        walked = loss(hidden, blocks, drafter.lm_head, temperatures=(0.7,))
        h = hidden.view(-1, B, 64)[:, 1:].reshape(-1, 64)
        anchors = blocks.input_ids.view(-1, B)[:, :1]
        prev = torch.cat([anchors, blocks.labels[:, :-1]], 1).reshape(-1)
        head = drafter.markov_head
        z = h @ drafter.lm_head.t() + head.markov_w1.weight[prev] @ head.markov_w2.weight.t()
        want = torch.log_softmax(z / 0.7, -1).gather(1, blocks.labels.reshape(-1, 1)).view(-1, B - 1)
    valid = blocks.valid[:walked.num_blocks]
    torch.testing.assert_close(walked.label_logq[..., 0][valid], want[:walked.num_blocks][valid].float())


def test_the_walk_reads_the_markov_path():
    """The loss's hits (without the target's states: the held-out walk) are the greedy Markov path's,
    walked from each block's anchor: the accepted prefix of `propose` against the labels is the leading hits."""
    target = tiny_target(9)
    drafter = tiny_dspark(target, seed=9, markov=2.0)
    batch = make_batch([12, 18], seed=9)
    feats = target.features(batch)
    from dflash.models import draw_blocks, slot_weights

    blocks = draw_blocks(batch, block_size=B, num_anchors=8, mask_token_id=MASK_ID, slot_weights=slot_weights(B, 2.0),
                         seed=0, epoch=0)
    loss = BlockLoss(terms=drafter_kind("dspark").terms(drafter, SimpleNamespace()))
    with torch.no_grad():
        hidden = drafter(batch, feats, blocks)
        out = loss(hidden, blocks, drafter.lm_head)
        states = hidden.view(-1, B, hidden.shape[-1])
        overruled = 0
        for j in range(blocks.num_blocks):
            path, _, _ = drafter.propose(states[j, 1:], int(blocks.input_ids[j * B]))
            ok = (path == blocks.labels[j]) & blocks.valid[j]
            assert int(ok.long().cumprod(0).sum()) == int(out.hits[j].long().cumprod(0).sum())
            overruled += int((path != drafter.logits(states[j, 1:]).argmax(-1)).sum())
    assert overruled > 0 and out.argmax_hits is not None  # the path is the Markov head's, not the argmax


# vLLM 0.32 Qwen3DSparkForCausalLM: the checkpoint names its load_weights maps (all but lm_head get "model."),
# the modules of Qwen3DSparkModel (DFlashQwen3Model's fc, hidden_norm, layers, norm; DSparkMarkovHead's
# markov_w1 (Embedding V x r) and markov_w2 (ParallelLMHead V x r); DSparkConfidenceHead's proj (1 x (H + r),
# bias)); embed_tokens and lm_head are the target's, left out.
def vllm_names(layers: int) -> set[str]:
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight"]
    return {"fc.weight", "hidden_norm.weight", "norm.weight", "markov_head.markov_w1.weight",
            "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias",
            *(f"layers.{i}.{n}" for i in range(layers) for n in per_layer)}


def test_the_export_has_vllms_names_and_keys_and_reloads_strictly(tmp_path):
    target = tiny_target(7)
    drafter = tiny_dspark(target, seed=7)
    drafter.save_pretrained(tmp_path / "ds")
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    # vLLM's num_speculative_tokens defaults to block_size: the query rows, B - 1 here
    assert config["block_size"] == B - 1
    assert config["sample_from_anchor"] is True and config["dspark_bonus_anchor"] is False
    assert (config["markov_rank"], config["markov_head_type"]) == (8, "vanilla")
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    assert config["target_layer_ids"] == config["dflash_config"]["target_layer_ids"] == TAPS
    assert config["mask_token_id"] == config["dflash_config"]["mask_token_id"] == MASK_ID
    from safetensors import safe_open

    with safe_open(tmp_path / "ds" / "model.safetensors", "pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert set(shapes) == vllm_names(2)
    H, V, R = 64, 300, 8
    assert shapes["markov_head.markov_w1.weight"] == shapes["markov_head.markov_w2.weight"] == [V, R]
    assert shapes["confidence_head.proj.weight"] == [1, H + R] and shapes["confidence_head.proj.bias"] == [1]
    loaded = DFlashDrafter.from_pretrained(tmp_path / "ds", target.shared_weights())
    assert isinstance(loaded, DSparkDrafter) and loaded.config.block_size == B
    assert loaded.config.kind_settings == SETTINGS
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # strict: a head's tensor missing is refused
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "ds" / "model.safetensors")
    del tensors["markov_head.markov_w2.weight"]
    save_file(tensors, tmp_path / "ds" / "model.safetensors")
    with pytest.raises(ValueError, match="markov_w2"):
        DFlashDrafter.from_pretrained(tmp_path / "ds", target.shared_weights())


def vllm_dspark_reads(c: dict) -> tuple:
    """What vLLM 0.32 takes from a Qwen3DSparkModel config.json (written from its code): the drafts per block
    (`num_speculative_tokens` defaults to `block_size`, `config/speculative.py`), the layout
    (`sample_from_anchor`, default true in the speculator), the target layers it taps (eagle3_utils: the
    first of dflash_config.target_layer_ids and the top-level target_layer_ids, + 1), the mask token
    (`get_parallel_drafting_token_id`: dflash_config first), the Markov rank and the confidence head's
    switches (`Qwen3DSparkModel`, both default false)."""
    dflash = c.get("dflash_config") or {}
    layers = dflash.get("target_layer_ids") or c.get("target_layer_ids")
    return (c.get("block_size"), c.get("sample_from_anchor", True), [i + 1 for i in layers],
            dflash.get("mask_token_id", c.get("mask_token_id")), c["markov_rank"],
            c.get("enable_confidence_head", False), c.get("confidence_head_with_markov", False))


def test_vllm_reads_from_the_export_what_the_drafter_computes():
    drafter = tiny_dspark(tiny_target(0))
    c = drafter.config.to_json_dict()
    assert vllm_dspark_reads(c) == (drafter.queries, True, [i + 1 for i in TAPS], MASK_ID, 8, True, True)
    assert drafter.queries == B - 1 == drafter.block_size - 1


@pytest.mark.parametrize("change,key", [({"sample_from_anchor": False}, "sample_from_anchor"),
                                        ({"markov_rank": None}, "markov_rank"),
                                        ({"markov_head_type": "rnn"}, "markov_head_type")])
def test_a_dspark_config_this_drafter_does_not_compute_is_refused_naming_the_key(change, key):
    d = tiny_config(tiny_target(0)).to_json_dict()
    d.update(change)
    with pytest.raises(ValueError, match=key):
        DrafterConfig.from_json_dict(d)


def test_the_flop_model_prices_the_markov_products():
    s = DSparkSettings(markov_rank=256)
    kind = drafter_kind("dspark")
    got = kind.row_flops(4096, 5, 16, s, SimpleNamespace(), vocab=151936)
    assert got == pytest.approx(15 / 16 * (6 * 256 * 151936 + 4 * (4096 + 256)))
    assert row_flops(151936, 4096, 16, DSparkSettings(markov_rank=256, enable_confidence_head=False)) == \
        pytest.approx(15 / 16 * 6 * 256 * 151936)


def small_dspark(hf, shared, block_size, seed, markov):
    config = DrafterConfig.from_target(hf.config, mask_token_id=hf.config.vocab_size - 1, block_size=block_size,
                                       draft_layers=1, target_layer_ids=[0], kind="dspark",
                                       kind_settings=DSparkSettings(markov_rank=4))
    drafter = DSparkDrafter(config, shared, attention_backend="torch").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.markov_head.parameters():
            p.copy_(markov * torch.randn(p.shape, generator=g))
    return drafter


@pytest.fixture(scope="module")
def tiny_dspark_sampler(tiny):  # noqa: F811 - the imported fixture
    """A DSpark drafter of block 3 (2 query rows, 2 drafts) on the chi-square test's tiny target, its
    Markov head strong (each draft's q depends on the one before)."""
    hf, _ = tiny
    shared = SharedWeights(hf.get_input_embeddings().weight, hf.lm_head.weight)
    return hf, small_dspark(hf, shared, 3, seed=5, markov=1.5)


def test_the_test_detects_dspark_drafts_verified_without_the_markov_bias(tiny_dspark_sampler, monkeypatch):
    """The Markov path's drafts verified as if drawn from the backbone's softmax alone: the output leaves
    the target's law (the chi-square test fails), so the conformance suite's sampling test
    (`test_speculative_sampling_draws_from_the_targets_law`) can fail for a DSpark drafter."""
    from ..decoding.test_speculative_sampling import (
        PROMPT,
        RUNS,
        chi_square_p_value,
        exact_law,
        outputs_verified_with_the_backbones_softmax,
    )

    hf, drafter = tiny_dspark_sampler
    # a quarter of the sampling test's outputs: p ~ 1e-90 with these (0 in float64 with all RUNS)
    got = outputs_verified_with_the_backbones_softmax(hf, drafter, monkeypatch, seed=6, runs=RUNS // 4)
    assert len(got) == RUNS // 4 and len(PROMPT) == 3
    assert chi_square_p_value(got, exact_law(hf, Sampling(1.0))) < 1e-8


@pytest.mark.parametrize("tv,buffers", [(0.9, 1 + 3), (0.0, 1 + 2)])
def test_the_memory_plan_counts_the_markov_terms_buffers_and_the_targets_states(tv, buffers):
    """The plan is made before the drafter exists: the kind's `term_costs` give the Markov term's chunk x
    vocab buffers (beside the pass's logits) and, with TV, the target's final states; the term built later
    holds what the plan counted."""
    from dflash.training.config import load_config
    from dflash.training.plan import loss_setup, resolve_run

    cfg = load_config(["--data", "d.jsonl", "--drafter-kind", "dspark", "--dspark-tv-weight", str(tv)])
    setup = loss_setup(resolve_run(cfg), "cpu")
    assert (setup["vocab_buffers"], setup["target_states"]) == (buffers, tv > 0)
    target = tiny_target(0)
    terms = drafter_kind("dspark").terms(tiny_dspark(target), cfg.loss)
    assert BlockLoss(terms=terms).vocab_buffers == buffers
