"""The DFlash2 drafter: its block-local convolution and selector against plain references, its start as a
DFlash drafter, its objective's gradients, and its checkpoint format (what every kind passes, decoding
against training among it: tests/drafter/test_kind_conformance.py)."""
from __future__ import annotations

import json

import pytest
import torch

from dflash.decoding.acceptance import walk_tau
from dflash.drafter.config_format import SLIDING
from dflash.drafter.kinds.dflash2 import (
    DFlash2Drafter,
    DFlash2Settings,
    SelectorTerm,
    block_conv,
    row_flops,
    selector_figures,
    unary_logits,
)
from dflash.models import Anchors, BlockLoss, DFlashDrafter, DrafterConfig, draw_blocks, slot_weights
from dflash.objective.anchors import to_packed
from dflash.objective.blocks import Blocks, block_scorer

from .drafter_helpers import MASK_ID, TAPS, B, make_batch, tiny_target

SETTINGS = DFlash2Settings(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=5,
                           output_multiplier=0.7, final_logit_softcapping=4.0, input_embedding_scale=1.5)


def tiny_config(target, settings=SETTINGS, window=6):
    return DrafterConfig.from_target(target.config, mask_token_id=MASK_ID, block_size=B, draft_layers=2,
                                     target_layer_ids=TAPS, layer_types=[SLIDING] * 2, sliding_window=window,
                                     is_causal=False, kind="dflash2", kind_settings=settings)


def tiny_dflash2(target, seed=0, settings=SETTINGS):
    """Every parameter random (the convolutions and the selector away from their identity start)."""
    drafter = DFlash2Drafter(tiny_config(target, settings), target.shared_weights())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else 0.15 * torch.randn(p.shape, generator=g))
    return drafter


def reference_conv(x, dynamic, base, block_size, group_size):
    """One output at a time: out[t, c] = sum_i (base[i, c] + dynamic[t, i, c // G]) x[t - i, c] over the
    taps that stay inside t's block."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for c in range(x.shape[1]):
            for i in range(base.shape[0]):
                if t % block_size - i >= 0:
                    out[t, c] += (base[i, c] + dynamic[t, i, c // group_size]) * x[t - i, c]
    return out


def test_block_conv_is_the_per_position_formula_and_stays_inside_each_block():
    g = torch.Generator().manual_seed(0)
    blocks, K, H, G = 3, 3, 8, 4
    x = torch.randn(blocks * B, H, generator=g, dtype=torch.float64)
    dynamic = torch.randn(blocks * B, K, H // G, generator=g, dtype=torch.float64)
    base = torch.randn(K, H, generator=g, dtype=torch.float64)
    got = block_conv(x, dynamic, base, B, G)
    torch.testing.assert_close(got, reference_conv(x, dynamic, base, B, G))
    # causal within the block: changing slot 1 of block 1 changes slots 1.. of block 1 only
    y = x.clone()
    y[B + 1] += 1.0
    changed = (block_conv(y, dynamic, base, B, G) != got).any(dim=1)
    assert changed.tolist() == [t in range(B + 1, 2 * B) for t in range(blocks * B)]


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_the_block_conv_op_leaves_the_drafters_outputs_and_gradients_as_the_reference_makes_them(monkeypatch,
                                                                                                 backend):
    """The drafter's convolutions through `dflash.ops.block_conv` (CPU: the recomputing path; Triton in the
    interpreter) against the same drafter with the plain reference (today's math, its whole graph kept)."""
    import dflash.drafter.kinds.dflash2 as module
    from dflash.ops.block_conv import block_conv as op
    from dflash.ops.block_conv.naive import block_conv_naive

    if backend == "triton":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("CPU tensors reach Triton only through the interpreter")
        monkeypatch.setattr(module, "block_conv", lambda *a: op(*a, backend="triton"))
    target = tiny_target(5)
    batch = make_batch([11, 23], seed=5)
    feats = target.features(batch)
    blocks = draw_blocks(batch, block_size=B, num_anchors=5, mask_token_id=MASK_ID, slot_weights=slot_weights(B, 2.0),
                         seed=0, epoch=0)

    def step():
        drafter = tiny_dflash2(target, seed=5)
        loss = BlockLoss(terms=[SelectorTerm(drafter.candidate_selector)], logit_scale=0.7, softcap=4.0)
        hidden = drafter(batch, feats, blocks)
        loss(hidden, blocks, target.shared_weights().lm_head).loss_sum.backward()
        return hidden.detach(), {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}

    hidden, grads = step()
    with monkeypatch.context() as m:
        m.setattr(module, "block_conv", block_conv_naive)
        want_hidden, want_grads = step()
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys() and any("base_kernel" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_outputs_of_the_convolutions_before_the_sublayers_are_remade_not_kept():
    """`RecomputedConvOutputs`: the sublayers' projections keep no copy of their input (the convolution's
    output) while the forward's states wait for the backward: at least one hidden-size vector per row
    and layer less than with the outputs kept, the same gradients."""
    from dflash.drafter.network import DFlashDrafter as Plain
    from dflash.sizing.tensor_bytes import measure_peak_tensor_bytes

    target = tiny_target(6)
    batch = make_batch([30, 41], seed=6)
    feats = target.features(batch)
    blocks = draw_blocks(batch, block_size=B, num_anchors=12, mask_token_id=MASK_ID, slot_weights=slot_weights(B, 2.0),
                         seed=0, epoch=0)

    def step(remade):
        drafter = tiny_dflash2(target, seed=6)
        forward = drafter.block_hidden if remade else lambda *a, **k: Plain.block_hidden(drafter, *a, **k)
        drafter.block_hidden = forward

        def run():
            hidden = drafter(batch, feats, blocks)
            (hidden.float().square().sum()).backward()
        peak, _ = measure_peak_tensor_bytes(run)
        return peak, {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}

    kept, kept_grads = step(False)
    remade, grads = step(True)
    rows, layers, hidden = blocks.input_ids.numel(), 2, target.config.hidden_size
    assert kept - remade >= rows * layers * hidden * 4, (kept, remade)
    for name in grads:
        torch.testing.assert_close(grads[name], kept_grads[name], msg=name)


def test_a_new_dflash2_drafter_computes_what_the_dflash_drafter_of_its_seed_does():
    target = tiny_target(4)
    config = tiny_config(target, DFlash2Settings(conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                                 selector_top_k=5))
    torch.manual_seed(7)
    dflash2 = DFlash2Drafter(config, target.shared_weights())
    torch.manual_seed(7)
    import dataclasses

    dflash = DFlashDrafter(dataclasses.replace(config, kind="dflash", kind_settings=None), target.shared_weights())
    batch = make_batch([12, 20], seed=4)
    feats = target.features(batch)
    blocks = draw_blocks(batch, block_size=B, num_anchors=6, mask_token_id=MASK_ID, slot_weights=slot_weights(B, 2.0),
                         seed=0, epoch=0)
    with torch.no_grad():
        h2, h1 = dflash2(batch, feats, blocks), dflash(batch, feats, blocks)
        assert torch.equal(h2, h1)
        hidden = h2.view(-1, B, h2.shape[-1])[0, 1:]
        path, _, _ = dflash2.propose(hidden, int(blocks.input_ids[0]))
        assert torch.equal(path, dflash2.logits(hidden).argmax(-1))  # every transition scores 0


def dense_selector_loss(drafter, hidden, blocks, stop_grad=False):
    """The selector's objective written out: full logits, top-K, the gold token injected, explicit scores."""
    sel = drafter.candidate_selector
    K = sel.top_k
    scored = hidden.view(-1, B, hidden.shape[-1])[:, 1:].reshape(-1, hidden.shape[-1])
    logits = unary_logits(scored @ drafter.lm_head.t(), drafter.config).detach()
    labels = blocks.labels.reshape(-1)
    prev = torch.cat([blocks.input_ids.view(-1, B)[:, :1], blocks.labels[:, :-1]], 1).reshape(-1)
    h = scored.detach() if stop_grad else scored
    total = torch.zeros(())
    A, Bc, P = sel.predecessor_codebook.weight, sel.successor_codebook.weight, sel.hidden_projection.weight
    for r in range(labels.numel()):
        values, cands = logits[r].topk(K)
        cands, values = cands.clone(), values.clone()
        if labels[r] not in cands:
            cands[-1], values[-1] = labels[r], logits[r, labels[r]]
        scores = values + ((A[prev[r]] * (P @ h[r]))[None, :] * Bc[cands]).sum(-1)
        target = int((cands == labels[r]).nonzero()[0, 0])
        total = total + blocks.weights.reshape(-1)[r] * (torch.logsumexp(scores, 0) - scores[target])
    return total


@pytest.mark.parametrize("head", ["off", "torch", "triton"],
                         ids=["torch-pass", "fused-head-torch", "fused-head-triton"])
@pytest.mark.parametrize("stop_grad", [False, True])
def test_selector_term_is_the_dense_objective_with_its_gradients(monkeypatch, stop_grad, head):
    """Through the loss room's own pass and through the fused head (`dflash.ops.head_topk`: its torch
    reference and its Triton kernels in the interpreter), which only the rows of positive weight reach."""
    import dflash.objective.loss as loss_module
    import dflash.ops.head_topk as head_ops

    monkeypatch.setattr(loss_module, "HEAD_BACKEND", head)
    reached = []
    fused = head_ops.head_topk
    monkeypatch.setattr(head_ops, "head_topk", lambda logits, *a, **k: reached.append(len(logits)) or fused(
        logits, *a, **k))
    target = tiny_target(5)
    drafter = tiny_dflash2(target, seed=5, settings=DFlash2Settings(
        conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4, output_multiplier=0.5,
        final_logit_softcapping=3.0))
    batch = make_batch([10, 16], seed=5)
    feats = target.features(batch)
    blocks = draw_blocks(batch, block_size=B, num_anchors=5, mask_token_id=MASK_ID, slot_weights=slot_weights(B, 2.0),
                         seed=0, epoch=0)
    s = drafter.config.kind_settings
    params = dict(drafter.named_parameters())

    def grads(loss_fn):
        drafter.zero_grad()
        hidden = drafter(batch, feats, blocks)
        loss = loss_fn(hidden)
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in params.items() if p.grad is not None}

    term = SelectorTerm(drafter.candidate_selector, 0.3, stop_grad)
    loss = BlockLoss(chunk_rows=7, terms=[term], logit_scale=s.output_multiplier, softcap=s.final_logit_softcapping)
    got, got_grads = grads(lambda h: loss(h, blocks, drafter.lm_head).loss_sum)

    def dense(h):
        scored = h.view(-1, B, h.shape[-1])[:, 1:].reshape(-1, h.shape[-1])
        logits = unary_logits(scored @ drafter.lm_head.t(), drafter.config)
        ce = torch.nn.functional.cross_entropy(logits, blocks.labels.reshape(-1), reduction="none")
        return (ce * blocks.weights.reshape(-1)).sum() + 0.3 * dense_selector_loss(drafter, h, blocks, stop_grad)

    ref, ref_grads = grads(dense)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == ref_grads.keys()
    for k in ref_grads:
        torch.testing.assert_close(got_grads[k], ref_grads[k], rtol=1e-4, atol=1e-5, msg=k)
    out = loss(drafter(batch, feats, blocks), blocks, drafter.lm_head)
    rows = int(blocks.valid.sum())
    assert out.metrics["selector_rows"] == rows and 0 <= out.metrics["selector_correct"] <= out.metrics[
        "selector_recall"] <= rows
    torch.testing.assert_close(out.parts["selector"], dense_selector_loss(drafter, drafter(batch, feats, blocks),
                                                                          blocks).detach(), rtol=1e-5, atol=1e-5)
    assert sum(reached) == (0 if head == "off" else 2 * int((blocks.weights > 0).sum()))  # two passes above
    assert head == "off" or int((blocks.weights > 0).sum()) < blocks.weights.numel()  # some rows were left out


def test_the_flop_model_prices_the_convolutions_and_the_selector_with_stop_grad_as_a_flop_counter_counts_a_step():
    """A training step (forward, loss, backward) of a DFlash2 drafter minus the same step of the DFlash
    drafter of its sizes, under FlopCounterMode, is exactly the DFlash2 cost model's per_row minus the
    DFlash one's, times the block rows (convolution projections in every layer, the selector on the
    scored rows; the taps' element-wise products are no matmuls, uncounted on both sides). With
    --selector-stop-grad (its default, every kind's: tests/drafter/test_kind_conformance.py)."""
    stop_grad = True
    import dataclasses

    from dflash.sizing.flops import flop_cost_model, measure_flops

    target = tiny_target(9)
    settings = DFlash2Settings(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=5)
    config = tiny_config(target, settings)
    batch = make_batch([11, 18], seed=9)
    feats = target.features(batch)
    blocks = draw_blocks(batch, block_size=B, num_anchors=4, mask_token_id=MASK_ID, slot_weights=slot_weights(B, 2.0),
                         seed=0, epoch=0)
    dflash2 = DFlash2Drafter(config, target.shared_weights())
    dflash = DFlashDrafter(dataclasses.replace(config, kind="dflash", kind_settings=None), target.shared_weights())

    def step(drafter, terms):
        BlockLoss(chunk_rows=5, terms=terms)(drafter(batch, feats, blocks), blocks, drafter.lm_head).loss_sum.backward()

    measured = measure_flops(step, dflash2, [SelectorTerm(dflash2.candidate_selector, 0.3, stop_grad)])[0] \
        - measure_flops(step, dflash, [])[0]
    sizes = dict(num_target_layers=max(TAPS) + 1, draft_layers=2, num_features=len(TAPS), block_size=B)
    priced = flop_cost_model(target.config, **sizes, extra_row_flops=row_flops(
        target.config.hidden_size, 2, B, settings, stop_grad))
    plain = flop_cost_model(target.config, **sizes)
    rows = blocks.input_ids.numel()
    assert rows == blocks.num_blocks * B > 0
    assert rows * (priced.per_row - plain.per_row) == measured > 0
    assert dataclasses.replace(priced, per_row=plain.per_row) == plain, "only the block rows cost more"


def test_selector_path_greedy_and_sampled_against_a_plain_walk():
    target = tiny_target(6)
    drafter = tiny_dflash2(target, seed=6)
    sel = drafter.candidate_selector
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B - 1, drafter.config.hidden_size, generator=g)
    unary = drafter.logits(hidden)
    A, Bc, P = sel.predecessor_codebook.weight, sel.successor_codebook.weight, sel.hidden_projection.weight
    with torch.no_grad():
        path, cands, q = drafter.propose(hidden, 11)
        assert q is None
        prev = 11
        for p in range(B - 1):
            values, c = unary[p].topk(sel.top_k)
            scores = values + ((A[prev] * (P @ hidden[p]))[None] * Bc[c]).sum(-1)
            prev = int(c[scores.argmax()])
            assert int(path[p]) == prev
        path, cands, q = drafter.propose(hidden, 11, 0.8, torch.Generator().manual_seed(1))
        prev = 11
        for p in range(B - 1):
            scores = unary[p].topk(sel.top_k).values + ((A[prev] * (P @ hidden[p]))[None] * Bc[cands[p]]).sum(-1)
            torch.testing.assert_close(q[p], torch.softmax(scores / 0.8, -1))
            assert int(path[p]) in cands[p].tolist()
            prev = int(path[p])


def test_export_writes_the_released_names_and_keys_and_loads_back(tmp_path):
    target = tiny_target(7)
    drafter = tiny_dflash2(target, seed=7)
    drafter.save_pretrained(tmp_path / "d2")
    config = json.loads((tmp_path / "d2" / "config.json").read_text())
    # the released fixture's keys (z-lab/dflash tests/fixtures/dflash2-config.json)
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert "block_size" not in config
    assert set(config["dflash_config"]) == {"block_size", "conv_group_size", "conv_kernel_size",
                                            "final_logit_softcapping", "mask_token_id", "output_multiplier",
                                            "selector_rank", "selector_top_k", "target_layer_ids",
                                            "input_embedding_scale",
                                            # stated for the engines (dflash.drafter.serving)
                                            "causal", "use_swa", "swa_window_size", "attention_sink_bias"}
    from safetensors import safe_open

    with safe_open(tmp_path / "d2" / "model.safetensors", "pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    H, V, R, K, G = 64, 300, 8, 3, 16
    assert shapes["candidate_selector.predecessor_codebook"] == [V, R]
    assert shapes["candidate_selector.successor_codebook"] == [V, R]
    assert shapes["candidate_selector.hidden_projection.weight"] == [R, H]
    assert shapes["layers.1.attention_conv.base_kernel"] == [2, K, H]
    assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == [2 * K * H // G, H]
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d2", target.shared_weights())
    assert isinstance(loaded, DFlash2Drafter)
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # the state_dict's names (`.weight` on the codebooks) load too
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, tmp_path / "d2" / "model.safetensors")
    again = DFlashDrafter.from_pretrained(tmp_path / "d2", target.shared_weights())
    assert torch.equal(again.candidate_selector.successor_codebook.weight,
                       drafter.candidate_selector.successor_codebook.weight)


@pytest.mark.parametrize("change,key", [
    ({"conv_group_size": None}, "dflash_config.conv_group_size"),
    ({"conv_group_size": 24}, "dflash_config.conv_group_size"),
    ({"selector_top_k": 0}, "dflash_config.selector_top_k"),
    ({"output_multiplier": -1.0}, "dflash_config.output_multiplier"),
])
def test_a_dflash2_config_the_engines_would_serve_otherwise_is_refused_naming_the_key(change, key):
    target = tiny_target(8)
    d = tiny_config(target).to_json_dict()
    for k, v in change.items():
        if v is None:
            d["dflash_config"].pop(k)
        else:
            d["dflash_config"][k] = v
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        DrafterConfig.from_json_dict(d)
    # the DFlash2 keys stay refused in a DFlash drafter's config
    d = tiny_config(target).to_json_dict()
    d["architectures"] = ["DFlashDraftModel"]
    with pytest.raises(ValueError, match="dflash_config.* which this drafter does not implement"):
        DrafterConfig.from_json_dict(d)


def test_the_walk_reads_the_selectors_path():
    """The loss's hits are the greedy selector path's, walked from each block's anchor: the accepted
    prefix of `propose` against the labels equals the leading hits; log q_t(label) is the selector's
    softmax over the candidates along the labels."""
    target = tiny_target(9)
    drafter = tiny_dflash2(target, seed=9, settings=DFlash2Settings(
        conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=40))
    with torch.no_grad():  # a selector that often overrules the unary argmax
        drafter.candidate_selector.hidden_projection.weight.mul_(20)
    batch = make_batch([12, 18], seed=9)
    feats = target.features(batch)
    blocks = draw_blocks(batch, block_size=B, num_anchors=8, mask_token_id=MASK_ID, slot_weights=slot_weights(B, 2.0),
                         seed=0, epoch=0)
    loss = BlockLoss(terms=[SelectorTerm(drafter.candidate_selector)])
    with torch.no_grad():
        hidden = drafter(batch, feats, blocks)
        out = loss(hidden, blocks, drafter.lm_head, temperatures=(0.5,))
        states = hidden.view(-1, B, hidden.shape[-1])
        overruled = 0
        for j in range(blocks.num_blocks):
            path, cands, _ = drafter.propose(states[j, 1:], int(blocks.input_ids[j * B]))
            ok = (path == blocks.labels[j]) & blocks.valid[j]
            assert int(ok.long().cumprod(0).sum()) == int(out.hits[j].long().cumprod(0).sum())
            overruled += int((path != drafter.logits(states[j, 1:]).argmax(-1)).sum())
            # slot 1: q over the candidates after the anchor
            _, _, q = drafter.propose(states[j, 1:2], int(blocks.input_ids[j * B]), 0.5, torch.Generator())
            label = blocks.labels[j, 0]
            want = torch.log(q[0][cands[0] == label].sum()) if blocks.valid[j, 0] else torch.tensor(float("-inf"))
            torch.testing.assert_close(out.label_logq[j, 0, 0], want.float())
        assert overruled > 0  # the path is the selector's, not the argmax


def test_the_official_dflash2_class_loads_the_export_strictly_with_the_same_outputs_and_path(tmp_path):
    """z-lab's DFlash2DraftModel (the PyPI wheel's dflash/model.py) loads our export with no missing or
    unexpected tensor and computes the same block states (each block alone after its context, as its
    decoding loop runs it) and the same greedy selector path."""
    from .official import official_dflash

    official = official_dflash()
    target = tiny_target(10)
    drafter = tiny_dflash2(target, seed=10)
    drafter.save_pretrained(tmp_path)
    model, info = official.DFlash2DraftModel.from_pretrained(tmp_path, dtype=torch.float32,
                                                             output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    embed, lm_head = target.shared_weights().embed, target.shared_weights().lm_head
    head = torch.nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False)
    head.weight.data = lm_head
    T, anchors = 21, [0, 5, 13, 20]
    g = torch.Generator().manual_seed(10)
    feats = torch.randn(T, len(TAPS) * drafter.config.hidden_size, generator=g)
    tokens = torch.randint(0, MASK_ID, (T,), generator=g)
    blocks = Anchors(torch.zeros(len(anchors), dtype=torch.int32), torch.tensor(anchors, dtype=torch.int32), B, 0)
    ids = torch.full((len(anchors), B), MASK_ID)
    ids[:, 0] = tokens[anchors]
    pos = torch.tensor(anchors)[:, None] + torch.arange(B)
    cu = torch.tensor([0, T], dtype=torch.int32)
    scale = drafter.config.kind_settings.input_embedding_scale
    with torch.no_grad():
        ours = drafter.block_hidden(feats, ids.reshape(-1), pos.reshape(-1), torch.arange(T), (cu, cu), blocks)
        ours = ours.view(-1, B, ours.shape[-1])
        for j, a in enumerate(anchors):
            theirs = model(position_ids=torch.arange(a + B)[None], noise_embedding=embed[ids[j]][None] * scale,
                           target_hidden=feats[:a][None])[0]
            torch.testing.assert_close(ours[j], theirs, rtol=1e-5, atol=1e-5, msg=f"anchor {a}")
            path, _, _ = model.propose(theirs[None, 1:], ids[j, :1], head, 0.0)
            torch.testing.assert_close(drafter.logits(ours[j, 1:]), model.compute_logits(theirs[1:], head),
                                       rtol=1e-5, atol=1e-5)
            assert drafter.propose(ours[j, 1:], int(ids[j, 0]))[0].tolist() == path[0].tolist()


def strong_selector(seed, top_k=4):
    """A tiny DFlash2 drafter whose selector often overrules the unary argmax, with a top-K that often
    misses the gold token."""
    target = tiny_target(seed)
    drafter = tiny_dflash2(target, seed=seed, settings=DFlash2Settings(
        conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=top_k, output_multiplier=0.8,
        final_logit_softcapping=5.0))
    with torch.no_grad():
        drafter.candidate_selector.hidden_projection.weight.mul_(20)
    return target, drafter


def selector_loss(drafter):
    s = drafter.config.kind_settings
    return BlockLoss(chunk_rows=7, terms=[SelectorTerm(drafter.candidate_selector)], logit_scale=s.output_multiplier,
                     softcap=s.final_logit_softcapping)


def test_selector_figures_are_the_counts_written_out_summed_over_micro_batches():
    """Candidate recall, selector accuracy and the backbone argmax's acceptance of two micro-batches of
    different sizes, from the summed `LossOutput.metrics`, against the same counts written out row by row
    over both (full logits, explicit transition scores, teacher-forced predecessors): sums over the whole
    step, not an average of the micro-batches' averages."""
    target, drafter = strong_selector(11)
    sel, K = drafter.candidate_selector, drafter.candidate_selector.top_k
    A, Bc, P = sel.predecessor_codebook.weight, sel.successor_codebook.weight, sel.hidden_projection.weight
    loss = selector_loss(drafter)
    sums, blocks_total = {}, 0
    rows = recalled = chosen = argmax_tau = 0
    for lengths, anchors, seed in (([12, 18], 8, 1), ([30], 3, 2)):
        batch = make_batch(lengths, seed=seed)
        blocks = draw_blocks(batch, block_size=B, num_anchors=anchors, mask_token_id=MASK_ID,
                             slot_weights=slot_weights(B, 2.0), seed=seed, epoch=0)
        with torch.no_grad():
            hidden = drafter(batch, target.features(batch), blocks)
            # labels the drafter can get right (the forward does not read them): per slot one of its unary
            # top-K or, one time in K + 1, a token outside them
            logits = unary_logits(hidden.view(-1, B, hidden.shape[-1])[:, 1:] @ drafter.lm_head.t(), drafter.config)
            pick = torch.randint(0, K + 1, blocks.labels.shape, generator=torch.Generator().manual_seed(seed))
            ranked = logits.topk(K + 1, dim=-1).indices
            outside = logits.argsort(dim=-1)[..., 0]  # the least likely token
            blocks.labels.copy_(torch.where(pick < K, ranked.gather(-1, pick[..., None].clamp_max(K - 1))[..., 0],
                                            outside))
            out = loss(hidden, blocks, drafter.lm_head)
        for k, v in out.metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        blocks_total += blocks.num_blocks
        states = hidden.view(-1, B, hidden.shape[-1])
        for j in range(blocks.num_blocks):
            logits = unary_logits(states[j, 1:] @ drafter.lm_head.t(), drafter.config)
            prev = int(blocks.input_ids[j * B])
            hits = []
            for k in range(B - 1):
                gold, valid = int(blocks.labels[j, k]), bool(blocks.valid[j, k])
                hits.append(valid and int(logits[k].argmax()) == gold)
                values, cands = logits[k].topk(K)
                scores = values + ((A[prev] * (P @ states[j, 1 + k]))[None] * Bc[cands]).sum(-1)
                rows += valid
                recalled += valid and gold in cands.tolist()
                chosen += valid and int(cands[scores.argmax()]) == gold
                prev = gold  # teacher forcing
            argmax_tau += 1 + int(torch.tensor(hits).long().cumprod(0).sum())
    got = selector_figures(sums, blocks_total)
    assert 0 < chosen < recalled < rows  # every figure is informative here
    assert got == pytest.approx({"selector_recall": recalled / rows, "selector_accuracy": chosen / rows,
                                 "argmax_anchor_tau": argmax_tau / blocks_total})


def test_the_walk_reports_the_selector_beside_the_backbones_argmax():
    """The eval walk of a DFlash2 drafter: `tau` along the selector's path, `argmax_tau` the walk of the
    same backbone drafting its argmax (= the walk scored without the selector), and the selector's recall
    and accuracy over every anchor's block; a DFlash drafter's walk has none of them."""
    target, drafter = strong_selector(12, top_k=6)
    s = drafter.config.kind_settings
    batch = make_batch([26], seed=3)
    with torch.no_grad():  # the turn the backbone's argmax drafts at slot 1: every block accepts a token or more
        for t in range(6, 26):
            anchors = Anchors(torch.zeros(1, dtype=torch.int32), torch.tensor([t - 1], dtype=torch.int32), B, 0)
            blocks = Blocks.build(anchors, to_packed(batch), MASK_ID, slot_weights(B, 2.0))
            hidden = drafter(batch, target.features(batch), blocks)
            batch.input_ids[t] = drafter.logits(hidden[1:2]).argmax()
    feats = target.features(batch)

    def walked(loss):
        score = block_scorer(drafter, loss, drafter.lm_head, mask_token_id=MASK_ID, slot_weights=slot_weights(B, 2.0))
        return walk_tau(score, batch, feats, block_size=B).metrics()

    with torch.no_grad():
        got = walked(selector_loss(drafter))
        plain = walked(BlockLoss(chunk_rows=7, logit_scale=s.output_multiplier, softcap=s.final_logit_softcapping))
    assert got["argmax_tau"] == plain["tau"] and got["argmax_anchor_tau"] == pytest.approx(plain["anchor_tau"])
    # every argmax block accepts its slot 1 and no more; the selector overrules some: its path is walked
    assert got["argmax_tau"] == 2 and got["tau"] < 2
    assert 0 < got["selector_accuracy"] <= got["selector_recall"] <= 1
    assert not {"argmax_tau", "selector_recall", "selector_accuracy"} & plain.keys()
