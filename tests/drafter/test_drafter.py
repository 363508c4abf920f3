"""The drafter's packed training forward against the inference formula, one block at a time."""
from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, rotate_half

from dflash.data.batch import PaddedBatch
from dflash.models import (
    Anchors,
    BlockLoss,
    DFlashDrafter,
    DrafterConfig,
    draw_blocks,
    slot_weights,
)

from .drafter_helpers import MASK_ID, TAPS, VOCAB, B, make_batch, run_blocks, tiny_target


def tiny_drafter(target, seed=0, layer_types=None, sliding_window=None, **kwargs):
    config = DrafterConfig.from_target(target.config, mask_token_id=MASK_ID, block_size=B, draft_layers=2,
                                       target_layer_ids=TAPS, layer_types=layer_types, sliding_window=sliding_window)
    drafter = DFlashDrafter(config, target.shared_weights(), **kwargs)
    # Larger than the 0.02 init, and non-trivial norms, so every term shows in the outputs.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else 0.15 * torch.randn(p.shape, generator=g))
    return drafter


def rope(x, cos, sin):
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def inference_block(drafter, feats, tokens, anchor):
    """The official inference formula for one block, written out densely.

    Context = this sample's fused features at positions 0..anchor-1, block = [anchor token,
    mask x (B-1)] at positions anchor..anchor+B-1, keys/values = [context; block]; no mask in a
    full layer, in a sliding layer (window W) key position kp <= query position p and p - kp < W.
    """
    cfg = drafter.config
    embed = drafter._shared.embed
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = drafter.hidden_norm(drafter.fc(feats[:anchor]))
    x = embed[torch.tensor([int(tokens[anchor])] + [MASK_ID] * (B - 1))]
    cos, sin = Qwen3RotaryEmbedding(cfg.to_qwen3_config())(x[None], torch.arange(anchor + B)[None])
    cos, sin = cos[0], sin[0]
    for i, layer in enumerate(drafter.layers):
        at = layer.self_attn
        h = layer.input_layernorm(x)
        q = rope(at.q_norm(at.q_proj(h).view(B, Hq, D)), cos[anchor:], sin[anchor:])
        k = rope(at.k_norm(torch.cat([at.k_proj(ctx), at.k_proj(h)]).view(-1, Hkv, D)), cos, sin)
        v = torch.cat([at.v_proj(ctx), at.v_proj(h)]).view(-1, Hkv, D)
        k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
        window, causal = cfg.layer_attention(i)
        qpos, kpos = torch.arange(anchor, anchor + B)[:, None], torch.arange(anchor + B)[None, :]
        keep = (kpos <= qpos) if causal else torch.ones(B, anchor + B, dtype=torch.bool)
        if window is not None:
            keep &= qpos - kpos < window
        p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        x = x + at.o_proj(torch.einsum("hqk,khd->qhd", p, v).reshape(B, Hq * D))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


def train_forward(drafter, batch, feats, *, num_anchors=512, chunk_rows=1024, epoch=0, seed=0):
    """The training forward: the loader's blocks, the drafter's hidden states, the loss (gamma 2)."""
    blocks = draw_blocks(batch, block_size=B, num_anchors=num_anchors, mask_token_id=MASK_ID,
                         slot_weights=slot_weights(B, 2.0), seed=seed, epoch=epoch)
    return BlockLoss(chunk_rows)(drafter(batch, feats, blocks), blocks, drafter.lm_head), blocks


@pytest.mark.parametrize("layer_types,window", [
    pytest.param(None, None, id="full"),
    pytest.param(["sliding_attention", "full_attention"], 5, id="sliding-full"),
])
def test_packed_forward_matches_inference_formula_block_by_block(layer_types, window):
    target = tiny_target()
    drafter = tiny_drafter(target, layer_types=layer_types, sliding_window=window)
    lengths = [11, 30, 19]
    batch = make_batch(lengths)
    feats = target.features(batch)
    # Anchors at the start (empty context), in the middle, overlapping, and at the last token.
    seq = [0, 0, 1, 1, 1, 1, 2]
    anchor = [0, 10, 3, 4, 17, 29, 9]
    anchors = Anchors(torch.tensor(seq, dtype=torch.int32), torch.tensor(anchor, dtype=torch.int32), B, 0)
    with torch.no_grad():
        got = run_blocks(drafter, batch, feats, anchors)
        cu = batch.cu_seqlens.tolist()
        for j, (s, a) in enumerate(zip(seq, anchor, strict=True)):
            ref = inference_block(drafter, feats[cu[s]:cu[s + 1]], batch.input_ids[cu[s]:cu[s + 1]], a)
            torch.testing.assert_close(got[j], ref, rtol=1e-5, atol=1e-5)


def test_loss_and_metrics_match_direct_computation():
    target = tiny_target(1)
    drafter = tiny_drafter(target, seed=1)
    batch = make_batch([25, 9, 40], seed=1)  # the 9-token sample has 4 < 2B supervised tokens
    feats = target.features(batch)
    out, blocks = train_forward(drafter, batch, feats, num_anchors=5, chunk_rows=7, epoch=1, seed=5)
    anchors = blocks.anchors
    assert out.num_skipped == 1 and out.num_blocks == anchors.num_blocks == 10

    w = slot_weights(B, 2.0)
    loss, weight, tau, correct, count = 0.0, 0.0, 0.0, torch.zeros(B - 1), torch.zeros(B - 1)
    cu, ids, lm = batch.cu_seqlens.tolist(), batch.input_ids, batch.loss_mask
    with torch.no_grad():
        for s, a in zip(anchors.block_seq.tolist(), anchors.block_anchor.tolist(), strict=True):
            n = cu[s + 1] - cu[s]
            lm_head = target.shared_weights().lm_head
            logits = inference_block(drafter, feats[cu[s]:cu[s + 1]], ids[cu[s]:], a) @ lm_head.t()
            accepting = True
            for k in range(1, B):
                ok = a + k < n and bool(lm[cu[s] + a + k])
                hit = ok and int(logits[k].argmax()) == int(ids[cu[s] + a + k])
                accepting = accepting and hit
                tau += accepting
                if ok:
                    loss += float(w[k - 1] * F.cross_entropy(logits[k], ids[cu[s] + a + k]))
                    weight += float(w[k - 1])
                    count[k - 1] += 1
                    correct[k - 1] += hit
            tau += 1
    assert out.loss_sum.item() == pytest.approx(loss, rel=1e-5)
    assert out.weight_sum.item() == pytest.approx(weight, rel=1e-6)
    assert out.tau_sum.item() == tau
    assert out.slot_correct.tolist() == correct.tolist() and out.slot_count.tolist() == count.tolist()


def test_padded_batch_gives_the_packed_result():
    target = tiny_target()
    drafter = tiny_drafter(target)
    lengths = [20, 33]
    packed = make_batch(lengths)
    S, L = 2, 33
    ids, pos = torch.zeros(S, L, dtype=torch.long), torch.zeros(S, L, dtype=torch.long)
    mask = torch.zeros(S, L, dtype=torch.bool)
    lm = torch.zeros(S, L, dtype=torch.bool)
    for i, (lo, hi) in enumerate(pairwise(packed.cu_seqlens.tolist())):
        n = hi - lo
        ids[i, :n], mask[i, :n], pos[i, :n] = packed.input_ids[lo:hi], True, torch.arange(n)
        lm[i, :n] = packed.loss_mask[lo:hi]
    padded = PaddedBatch(ids, mask, lm, pos, torch.tensor(lengths), packed.sample_ids)
    a = train_forward(drafter, packed, target.features(packed), num_anchors=3)[0]
    b = train_forward(drafter, padded, target.features(padded), num_anchors=3)[0]
    torch.testing.assert_close(a.loss_sum, b.loss_sum, rtol=1e-5, atol=1e-5)
    assert a.num_blocks == b.num_blocks == 6 and a.tau_sum == b.tau_sum


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    target = tiny_target()
    batch = make_batch([20, 33, 17])
    feats = target.features(batch)
    grads = []
    for checkpointing in (False, True):
        drafter = tiny_drafter(target, activation_checkpointing=checkpointing)
        calls = []
        drafter.layers[0].register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        out = train_forward(drafter, batch, feats, num_anchors=3)[0]
        out.loss_sum.backward()
        assert len(calls) == (2 if checkpointing else 1), "checkpointing recomputes the layer in backward"
        grads.append((out.loss_sum.detach(), {n: p.grad for n, p in drafter.named_parameters()}))
    (loss_a, grad_a), (loss_b, grad_b) = grads
    assert loss_a == loss_b and grad_a.keys() == grad_b.keys()
    for name in grad_a:
        torch.testing.assert_close(grad_a[name], grad_b[name], rtol=0, atol=0, msg=name)


def test_micro_batch_without_blocks_still_backpropagates():
    target = tiny_target()
    drafter = tiny_drafter(target)
    batch = make_batch([8, 9], prompt=5)  # 3 and 4 supervised tokens: both samples skipped
    out = train_forward(drafter, batch, target.features(batch))[0]
    assert out.num_blocks == 0 and out.num_skipped == 2
    assert out.loss_sum.item() == 0.0 and out.weight_sum.item() == 0.0 and out.tau_sum.item() == 0.0
    out.loss_sum.backward()
    assert all(p.grad is not None for p in drafter.parameters())


def test_drafter_owns_only_trainable_parameters():
    target = tiny_target()
    drafter = tiny_drafter(target)
    cfg = drafter.config
    H, D, I, K = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, len(TAPS)
    per_layer = H * D * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 3 * H * I + 2 * H + 2 * D
    assert sum(p.numel() for p in drafter.parameters()) == K * H * H + 2 * H + cfg.num_hidden_layers * per_layer
    assert sum(t.numel() for t in drafter.state_dict().values()) == sum(p.numel() for p in drafter.parameters())
    shared = target.shared_weights()
    assert all(p is not shared.embed and p is not shared.lm_head for p in drafter.parameters())

    batch = make_batch([30, 26])
    train_forward(drafter, batch, target.features(batch), seed=3)[0].loss_sum.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    assert shared.embed.grad is None and shared.lm_head.grad is None


def test_bf16_drafter_close_to_fp32():
    target = tiny_target()
    drafter = tiny_drafter(target)
    batch = make_batch([30, 26])
    feats = target.features(batch)
    ref = train_forward(drafter, batch, feats, num_anchors=4, seed=2)[0]
    out = train_forward(drafter.to(torch.bfloat16), batch, feats, num_anchors=4, seed=2)[0]
    assert out.loss_sum.dtype == torch.float32
    torch.testing.assert_close(out.loss_sum / out.weight_sum, ref.loss_sum / ref.weight_sum, rtol=3e-2, atol=3e-2)


def test_tau_counts_leading_slots_that_match_the_data():
    """With one block per sample, its labels (a+1..a+B-1) are neither its inputs nor its context,
    so they can be set to the drafter's own argmax without changing that argmax."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    batch = make_batch([24, 30, 28])
    anchors = train_forward(drafter, batch, target.features(batch), num_anchors=1)[1].anchors
    lm_head = target.shared_weights().lm_head
    cu = batch.cu_seqlens.tolist()
    feats = target.features(batch)
    matches = [3, 0, 1]  # leading slots made correct, then one wrong slot
    with torch.no_grad():
        for s, a in zip(anchors.block_seq.tolist(), anchors.block_anchor.tolist(), strict=True):
            assert a + B <= cu[s + 1] - cu[s]  # all labels inside the sample (true for this seed)
            logits = inference_block(drafter, feats[cu[s]:cu[s + 1]], batch.input_ids[cu[s]:], a) @ lm_head.t()
            pred = logits.argmax(-1)
            for k in range(1, B):
                good = int(pred[k])
                batch.input_ids[cu[s] + a + k] = good if k <= matches[s] else (good + 1) % (VOCAB - 1)
    out = train_forward(drafter, batch, target.features(batch), num_anchors=1)[0]
    assert out.num_blocks == 3
    assert out.tau_sum.item() == sum(m + 1 for m in matches)
    assert out.slot_correct.tolist() == [2, 1, 1]
