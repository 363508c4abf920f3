"""What is LiLiCorr's own (the conformance suite, test_kind_conformance.py, covers the rest: export and
reload, decoding equal to training, lossless greedy and sampled decoding): its correlator against a plain
reference that reads the export by the names vLLM 0.32 loads, its walk, its objective against a dense
reference, its config keys, and sampled decoding failing the chi-square test when the walk's draws are
verified with the backbone's softmax."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from dflash.decoding.sampling import Sampling
from dflash.drafter.kinds import drafter_kind
from dflash.drafter.kinds.lilicorr import (
    LatticeTerm,
    LiLiCorrDrafter,
    LiLiCorrSettings,
    head_parameters,
    released_settings,
    row_flops,
    walk,
)
from dflash.models import (
    BlockLoss,
    DFlashDrafter,
    DrafterConfig,
    SharedWeights,
    draw_blocks,
    slot_weights,
)

from ..decoding.test_speculative_sampling import VOCAB, tiny  # noqa: F401 (a fixture)
from .drafter_helpers import MASK_ID, TAPS, B, make_batch, tiny_target

SETTINGS = LiLiCorrSettings(candidate_topk=4, hidden_size=48, num_layers=2, num_heads=4, mlp_ratio=1.5,
                            factor_dim=8, vector_eps=1e-4, logit_scale=6.0)


def tiny_config(target, settings=SETTINGS, block_size=B):
    return DrafterConfig.from_target(target.config, mask_token_id=MASK_ID, block_size=block_size, draft_layers=2,
                                     target_layer_ids=TAPS, kind="lilicorr", kind_settings=settings)


def randomize(drafter, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.startswith("lilicorr."):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if "norm.weight" in name
                        else scale * torch.randn(p.shape, generator=g))
    return drafter


def tiny_lilicorr(target, seed=0, settings=SETTINGS):
    return randomize(LiLiCorrDrafter(tiny_config(target, settings), target.shared_weights(),
                                     attention_backend="torch"), seed)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_scores(t: dict, config, embed, candidates, log_probs, pass_hidden, anchor_hidden, anchor_valid):
    """vLLM 0.32's `LiLiCorrHead.score` and `forward` for one block, written out over the checkpoint's tensors
    `t` by the names its `load_weights` expects (`lilicorr.` + the head's parameter names): candidates (S, K),
    log_probs (S, K), pass_hidden (S, H), anchor_hidden (H,) -> (start (K,), pair (S - 1, K, K))."""
    s, eps = config.kind_settings, config.rms_norm_eps
    S, K = candidates.shape
    h = s.hidden_size or config.hidden_size
    g = lambda name: t["lilicorr." + name]  # noqa: E731

    def lin(x, name):
        return x @ g(name + ".weight").t() + g(name + ".bias")

    def mlp(x, name):
        return lin(F.silu(lin(x, name + ".up_proj")), name + ".down_proj")

    tok = embed[candidates]
    tok = lin(tok, "token_proj") if "lilicorr.token_proj.weight" in t else tok
    rank = torch.arange(K).float() / (K - 1)
    feats = torch.stack([log_probs, log_probs.exp(), log_probs - log_probs.max(-1, keepdim=True).values,
                         rank.expand(S, K), (rank == 0).float().expand(S, K)], -1)
    feats = F.layer_norm(feats, (5,), g("feature_norm.weight"), g("feature_norm.bias"))
    x = (tok + lin(pass_hidden, "pass_hidden_proj")[:, None] + mlp(feats, "feature_mlp")
         + g("slot_embedding")[0, 0, :S] + g("rank_embedding")[0, 0]).reshape(S * K, h)
    slot = torch.arange(S).repeat_interleave(K)
    heads = s.num_heads
    bias = torch.zeros(heads, S * K, S * K)
    for i in range(S * K):
        for j in range(S * K):
            bias[:, i, j] = g("relative_slot_bias")[:, slot[i] - slot[j] + B - 1] + \
                (g("same_slot_bias") if slot[i] == slot[j] else 0)
    for layer in range(s.num_layers):
        p = f"layers.{layer}."
        y = rms(x, g(p + "attn_norm.weight"), eps)
        q, k, v = (y @ g(p + "attn.in_proj_weight").t() + g(p + "attn.in_proj_bias")).chunk(3, -1)
        d = h // heads
        q, k, v = (z.view(S * K, heads, d).transpose(0, 1) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d) + bias, -1) @ v
        x = x + lin(att.transpose(0, 1).reshape(S * K, h), p + "attn.out_proj")
        x = x + mlp(rms(x, g(p + "mlp_norm.weight"), eps), p + "mlp")
    x = rms(x, g("output_norm.weight"), eps).view(S, K, h)
    a = rms(lin(anchor_hidden, "context_proj") * float(anchor_valid), g("anchor_norm.weight"), eps)
    f = F.silu(lin(torch.cat([x, a.expand_as(x), x * a], -1), "factor_input_proj"))

    def unit(z):
        return z / z.norm(dim=-1, keepdim=True).clamp_min(s.vector_eps)

    out, into, a_out = unit(lin(f, "out_head")), unit(lin(f, "in_head")), unit(lin(a, "anchor_out_head"))
    start = into[0] @ a_out
    pair = torch.stack([out[i] @ into[i + 1].t() for i in range(S - 1)])
    return s.logit_scale * start, s.logit_scale * pair


def exported(drafter, folder):
    from safetensors.torch import load_file

    drafter.save_pretrained(folder)
    return load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text())


def vllm_head_names(settings, hidden) -> set[str]:
    """The `lilicorr.*` tensors vLLM 0.32's `LiLiCorrHead` holds (and its loader requires), read from
    `model_executor/models/lilicorr.py`: ReplicatedLinear (bias), nn.LayerNorm, NemotronHMLP with bias,
    nn.RMSNorm, the lattice attention's bare in_proj parameters."""
    linears = ["pass_hidden_proj", "context_proj", "factor_input_proj", "out_head", "in_head", "anchor_out_head",
               "feature_mlp.up_proj", "feature_mlp.down_proj"]
    if (settings.hidden_size or hidden) != hidden:
        linears.append("token_proj")
    names = {f"{m}.{p}" for m in linears for p in ("weight", "bias")}
    names |= {"feature_norm.weight", "feature_norm.bias", "slot_embedding", "rank_embedding", "relative_slot_bias",
              "same_slot_bias", "output_norm.weight", "anchor_norm.weight"}
    for i in range(settings.num_layers):
        p = f"layers.{i}."
        names |= {p + n for n in ("attn_norm.weight", "attn.in_proj_weight", "attn.in_proj_bias",
                                  "attn.out_proj.weight", "attn.out_proj.bias", "mlp_norm.weight", "mlp.up_proj.weight",
                                  "mlp.up_proj.bias", "mlp.down_proj.weight", "mlp.down_proj.bias")}
    return {"lilicorr." + n for n in names}


@pytest.mark.parametrize("width", [48, 0])
def test_the_correlator_is_vllms_score_over_the_exported_tensors(tmp_path, width):
    """Our correlator's (start, pair) equal vLLM's score written out over the export (which therefore
    holds every tensor by the names vLLM's loader reads, and no other), with and without token_proj."""
    target = tiny_target(1)
    settings = LiLiCorrSettings(**{**SETTINGS.__dict__, "hidden_size": width})
    drafter = tiny_lilicorr(target, seed=1, settings=settings)
    tensors, _ = exported(drafter, tmp_path)
    H = drafter.config.hidden_size
    head = {k for k in tensors if k.startswith("lilicorr.")}
    assert head == vllm_head_names(settings, H)
    assert set(tensors) - head == set(DFlashDrafter(drafter.config.__class__(**{
        **drafter.config.__dict__, "kind": "dflash", "kind_settings": None})).state_dict())
    assert sum(tensors[k].numel() for k in head) == head_parameters(settings, H, B)
    if "lilicorr.token_proj.weight" in tensors:
        assert list(tensors["lilicorr.token_proj.weight"].shape) == [48, H]
    g = torch.Generator().manual_seed(1)
    S, K = B - 1, settings.candidate_topk
    hidden = torch.randn(2, S, H, generator=g)
    logits = torch.randn(2, S, 300, generator=g) * 3
    anchor = torch.randn(2, H, generator=g)
    valid = torch.tensor([True, False])
    with torch.no_grad():
        candidates, start, pair = drafter.lattice(hidden, logits, anchor, valid)
    embed = target.shared_weights().embed
    for j in range(2):
        values, ids = logits[j].topk(K, -1)
        assert torch.equal(candidates[j], ids)
        want = reference_scores(tensors, drafter.config, embed, ids, values - logits[j].logsumexp(-1, keepdim=True),
                                hidden[j], anchor[j], valid[j])
        torch.testing.assert_close(start[j], want[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pair[j], want[1], rtol=1e-4, atol=1e-4)


def test_the_walk_takes_each_slots_row_after_the_pick_before_it():
    g = torch.Generator().manual_seed(2)
    start, pair = torch.randn(4, generator=g) * 3, torch.randn(5, 4, 4, generator=g) * 3
    picks, q = walk(start, pair)
    assert q is None
    prev = int(start.argmax())
    assert int(picks[0]) == prev
    for s in range(5):
        prev = int(pair[s, prev].argmax())
        assert int(picks[s + 1]) == prev
    picks, q = walk(start, pair, 0.7, torch.Generator().manual_seed(0))
    torch.testing.assert_close(q[0], torch.softmax(start / 0.7, -1))
    for s in range(5):
        torch.testing.assert_close(q[s + 1], torch.softmax(pair[s, picks[s]] / 0.7, -1))


def dense_lattice_loss(drafter, hidden, blocks, weights, margin, target_states, cu, logprob_grad):
    """ModelOpt's three terms written out block by block and slot by slot (row-weighted as the DFlash CE), the
    candidates' log-probabilities from the full logits (detached unless `logprob_grad`)."""
    w_ce, w_m, w_p = weights
    S = B - 1
    states = hidden.view(-1, B, hidden.shape[-1])
    total = hidden.new_zeros(())
    lm_head = drafter.lm_head
    for j in range(blocks.num_blocks):
        if not bool(blocks.valid[j].all()):
            continue
        anchor_hidden, valid = drafter.block_anchors[0][j:j + 1], drafter.block_anchors[1][j:j + 1]
        logits = drafter.logits(states[j, 1:])
        logits = logits if logprob_grad else logits.detach()
        candidates, start, pair = drafter.lattice(states[j:j + 1, 1:], logits[None], anchor_hidden, valid)
        row, prev = start[0], None
        for s in range(S):
            if s:
                row = pair[0, s - 1, prev]
            gold = int(blocks.labels[j, s])
            ids = candidates[0, s].tolist()
            if gold not in ids:
                break
            i = ids.index(gold)
            ce = -torch.log_softmax(row, -1)[i]
            others = torch.cat([row[:i], row[i + 1:]])
            hinge = torch.relu(margin - (row[i] - others.max()))
            pos = int(cu[blocks.anchors.block_seq[j]]) + int(blocks.anchors.block_anchor[j]) + s
            z = lm_head[candidates[0, s]] @ target_states[pos]
            pen = (torch.softmax(row, -1) * (z[i] - z).clamp_min(0)).sum()
            total = total + blocks.weights[j, s] * (w_ce * ce + w_m * hinge + w_p * pen)
            prev = i
    return total


@pytest.mark.parametrize("logprob_grad", [True, False])
def test_the_lattice_term_is_the_dense_objective_with_its_gradients(logprob_grad):
    target = tiny_target(3)
    drafter = tiny_lilicorr(target, seed=3, settings=LiLiCorrSettings(**{**SETTINGS.__dict__, "candidate_topk": 16}))
    batch = make_batch([14, 20], seed=3)
    feats, tstates = target.features(batch, with_output=True)
    blocks = draw_blocks(batch, block_size=B, num_anchors=8, mask_token_id=MASK_ID, slot_weights=slot_weights(B, 2.0),
                         seed=0, epoch=0)
    with torch.no_grad():  # the labels (which the forward does not read) mostly among the top-K: paths supervised
        top = drafter.logits(drafter(batch, feats, blocks).view(-1, B, 64)[:, 1:]).topk(16, -1).indices
        g = torch.Generator().manual_seed(3)
        pick = top.gather(2, torch.randint(0, 16, (*top.shape[:2], 1), generator=g)).squeeze(2)
        blocks.labels.copy_(torch.where(torch.rand(pick.shape, generator=g) < 0.85, pick, blocks.labels))
    weights, margin = (0.3, 0.2, 0.4), 1.5
    term = LatticeTerm(drafter, *weights, margin=margin, logprob_grad=logprob_grad)
    loss = BlockLoss(ce_weight=0.0, terms=[term])
    params = [p for n, p in drafter.named_parameters() if n.startswith(("lilicorr.", "fc.", "layers.1.mlp"))]
    out = loss(drafter(batch, feats, blocks), blocks, drafter.lm_head,
               context={"target_states": tstates, "cu_seqlens": batch.cu_seqlens})
    got = torch.autograd.grad(out.loss_sum, params)
    hidden = drafter(batch, feats, blocks)
    want_loss = dense_lattice_loss(drafter, hidden, blocks, weights, margin, tstates, batch.cu_seqlens, logprob_grad)
    assert float(out.metrics["lattice_supervised"]) >= 4  # the objective covers several rows
    torch.testing.assert_close(out.loss_sum, want_loss, rtol=1e-4, atol=1e-5)
    want = torch.autograd.grad(want_loss, params)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=2e-5)
    assert any(float(a.abs().sum()) > 0 for a in got)


def test_export_writes_vllms_config_keys(tmp_path):
    target = tiny_target(5)
    drafter = tiny_lilicorr(target, seed=5)
    _, config = exported(drafter, tmp_path / "d")
    assert config["architectures"] == ["LiLiCorrDraftModel"] and "block_size" not in config
    d = config["dflash_config"]
    # every key vLLM 0.32's LiLiCorrHead and LiLiCorr read from dflash_config
    assert {k: d[k] for k in ("lilicorr_enabled", "block_size", "conv_kernel_size", "conv_group_size",
                              "lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers",
                              "lilicorr_num_heads", "lilicorr_mlp_ratio", "lilicorr_factor_dim",
                              "lilicorr_vector_eps", "lilicorr_logit_scale")} == {
        "lilicorr_enabled": True, "block_size": B, "conv_kernel_size": 0, "conv_group_size": 0,
        "lilicorr_candidate_topk": 4, "lilicorr_hidden_size": 48, "lilicorr_num_layers": 2, "lilicorr_num_heads": 4,
        "lilicorr_mlp_ratio": 1.5, "lilicorr_factor_dim": 8, "lilicorr_vector_eps": 1e-4, "lilicorr_logit_scale": 6.0}


@pytest.mark.parametrize("change,key", [
    ({"lilicorr_candidate_topk": 3}, "lilicorr_candidate_topk"),
    ({"lilicorr_candidate_topk": None}, "lilicorr_candidate_topk"),
    ({"lilicorr_num_heads": 5}, "lilicorr_num_heads"),
    ({"lilicorr_vector_eps": 0.0}, "lilicorr_vector_eps"),
    ({"lilicorr_logit_scale": -1.0}, "lilicorr_logit_scale"),
    ({"conv_kernel_size": 2}, "conv_kernel_size"),
    ({"lilicorr_enabled": False}, "lilicorr_enabled"),
])
def test_a_lilicorr_config_vllm_would_serve_otherwise_is_refused_naming_the_key(change, key):
    target = tiny_target(6)
    d = tiny_config(target).to_json_dict()
    for k, v in change.items():
        if v is None:
            d["dflash_config"].pop(k)
        else:
            d["dflash_config"][k] = v
    with pytest.raises(ValueError, match=key):
        DrafterConfig.from_json_dict(d)


def test_the_flop_model_counts_a_step_as_a_flop_counter_does():
    """row_flops x rows = what torch's FlopCounterMode counts for the correlator's forward and backward
    (matrix products only), the penalty's target logits apart."""
    from torch.utils.flop_counter import FlopCounterMode

    target = tiny_target(7)
    for width in (48, 0):
        settings = LiLiCorrSettings(**{**SETTINGS.__dict__, "hidden_size": width})
        drafter = tiny_lilicorr(target, seed=7, settings=settings)
        H, n, S, K = drafter.config.hidden_size, 3, B - 1, settings.candidate_topk
        g = torch.Generator().manual_seed(7)
        hidden = torch.randn(n, S, H, generator=g, requires_grad=True)
        anchor = torch.randn(n, H, generator=g, requires_grad=True)
        emb = torch.randn(n, S, K, H, generator=g)
        logp = torch.log_softmax(torch.randn(n, S, K, generator=g), -1)
        with FlopCounterMode(display=False) as counter:
            start, pair = drafter.lilicorr(emb, logp, hidden, anchor, torch.ones(n, dtype=torch.bool))
            (start.sum() + pair.sum()).backward()
        measured = counter.get_total_flops()
        priced = row_flops(H, 2, B, settings, penalty=False, logprob_grad=False) * n * B
        assert abs(priced - measured) / measured < 0.02, (priced, measured)
    assert row_flops(H, 2, B, settings, True, False) - row_flops(H, 2, B, settings, False, False) == 2 * S * K * H / B


def test_released_settings_and_options():
    s = released_settings()
    assert (s.candidate_topk, s.hidden_size, s.num_layers, s.num_heads, s.mlp_ratio, s.factor_dim, s.vector_eps,
            s.logit_scale) == (8, 1024, 2, 8, 2.0, 1024, 1e-4, 8.0)
    kind = drafter_kind("lilicorr")
    assert kind.architecture == "LiLiCorrDraftModel"
    assert {n: o.default for n, o in kind.options.items()} == {
        "lilicorr_ce_weight": 0.25, "lilicorr_margin_weight": 0.0, "lilicorr_penalty_weight": 0.25,
        "lilicorr_margin": 2.0, "lilicorr_logprob_grad": True}
    (term,) = kind.terms(tiny_lilicorr(tiny_target(8)), None)
    assert term.weights == (0.25, 0.0, 0.25) and term.margin == 2.0 and term.needs_target_states
    assert term.logprob_grad and term.head_top_k is None  # the softmax is read: no fused head
    with pytest.raises(ValueError, match="lattice weights"):
        LatticeTerm(tiny_lilicorr(tiny_target(8)), 0.0, 0.0, 0.0)


@pytest.fixture(scope="module")
def tiny_lattice(tiny):  # noqa: F811 (the fixture imported above)
    """A random LiLiCorr drafter on the 4-token target of test_speculative_sampling: top-2 of the 4 tokens."""
    hf, _ = tiny
    config = DrafterConfig.from_target(hf.config, mask_token_id=VOCAB - 1, block_size=3, draft_layers=1,
                                       target_layer_ids=[0], kind="lilicorr", kind_settings=LiLiCorrSettings(
                                           candidate_topk=2, hidden_size=16, num_layers=1, num_heads=2, mlp_ratio=2.0,
                                           factor_dim=4, vector_eps=1e-4, logit_scale=4.0))
    drafter = LiLiCorrDrafter(config, SharedWeights(hf.get_input_embeddings().weight, hf.lm_head.weight),
                              attention_backend="torch").eval()
    return hf, randomize(drafter, 9, scale=1.0)


def test_the_test_detects_lattice_drafts_verified_with_the_backbones_softmax(tiny_lattice, monkeypatch):
    from ..decoding.test_speculative_sampling import (
        chi_square_p_value,
        exact_law,
        outputs_verified_with_the_backbones_softmax,
    )

    hf, drafter = tiny_lattice
    got = outputs_verified_with_the_backbones_softmax(hf, drafter, monkeypatch, seed=5)
    assert chi_square_p_value(got, exact_law(hf, Sampling(1.0))) < 1e-8
