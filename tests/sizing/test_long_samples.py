"""Long samples on the CPU: one sample of 32,768 or 65,536 tokens with 2,048 or 4,096 anchors plans, trains
a step (target features, drafter forward and backward, loss, optimizer step) and decodes (the eval walk,
and the decoding forward on a DrafterCache of every context row), within its memory plan. Tiny hidden sizes,
sliding-window target and drafter layers: the drafter's block attention runs the chunked reference
(`dflash.ops.dflash_block.chunked`), the target's the windowed reference a tile of rows at a time."""
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash.data.batch import PackedBatch
from dflash.decoding.acceptance import every_anchor, score_and_walk
from dflash.drafter.config_format import SLIDING
from dflash.drafter.network import DrafterCache
from dflash.models import DFlashDrafter, DrafterConfig, TargetModel, draw_blocks, slot_weights
from dflash.objective.blocks import Blocks, block_scorer
from dflash.ops.dflash_block import chunked
from dflash.sizing import reference_attention
from dflash.sizing.memory import DrafterSizes, MemoryPlan, MemorySetup, target_sizes
from dflash.sizing.tensor_bytes import measure_peak_tensor_bytes
from dflash.testing import tiny_qwen3_config
from dflash.training.config import load_config
from dflash.training.models import training_loss
from dflash.training.plan import loss_setup, resolve_run

B, MASK, VOCAB = 16, 255, 256
pytestmark = pytest.mark.usefixtures("one_thread")


def build_models():
    """(target config, target, drafter, run config, loss): a tiny sliding-window Qwen3 target (hidden 32,
    2 layers, window 256), a 2-layer sliding drafter (window 64, block 16), fp32."""
    torch.manual_seed(0)
    config = tiny_qwen3_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               head_dim=16, max_position_embeddings=65600, layer_types=[SLIDING] * 2,
                               sliding_window=256, use_sliding_window=True)
    target = TargetModel(AutoModelForCausalLM.from_config(config), [0], attention_backend="torch")
    dcfg = DrafterConfig.from_target(config, mask_token_id=MASK, block_size=B, draft_layers=2, target_layer_ids=[0],
                                     layer_types=[SLIDING] * 2, sliding_window=64)
    drafter = DFlashDrafter(dcfg, target.shared_weights(), attention_backend="auto")
    cfg = load_config(["--data", "d.jsonl", "--block-size", str(B)])
    return config, target, drafter, cfg, training_loss(cfg.loss, cfg.drafter.block_size, drafter)


@pytest.fixture(scope="module")
def models():
    return build_models()


def one_sample(length, supervised_from=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, length], dtype=torch.int32)
    mask = torch.zeros(length, dtype=torch.bool)
    mask[supervised_from:] = True
    return PackedBatch(input_ids=torch.randint(0, VOCAB - 1, (length,), generator=g), loss_mask=mask,
                       position_ids=torch.arange(length), cu_seqlens=cu, cu_seqlens_cpu=cu.clone(),
                       max_seqlen=length, sample_ids=torch.zeros(1, dtype=torch.long))


@pytest.fixture(scope="module")
def long_sample(models):
    """A 65,536-token sample and its target features (the varlen reference a tile of rows at a time)."""
    batch = one_sample(65536, seed=1)
    return batch, models[1].features(batch)


def loss_and_grads(target, drafter, loss, batch, blocks, features=None):
    drafter.zero_grad(set_to_none=True)
    features = target.features(batch) if features is None else features
    out = loss(drafter(batch, features, blocks), blocks, drafter.lm_head)
    (out.loss_sum / out.weight_sum).backward()
    return float(out.loss_sum.detach() / out.weight_sum), {n: p.grad.clone() for n, p in drafter.named_parameters()}


def test_a_step_through_the_chunked_reference_equals_the_plain_one(models, monkeypatch):
    """The shorter equivalent of the long step: 2,048 tokens, 128 anchors, where the plain reference still
    runs: the drafter's loss and every parameter's gradient are the plain reference's."""
    _, target, drafter, _, loss = models
    batch = one_sample(2048)
    blocks = draw_blocks(batch, block_size=B, num_anchors=128, mask_token_id=MASK, slot_weights=slot_weights(B, 7.0),
                         seed=0, epoch=0)
    plain, plain_grads = loss_and_grads(target, drafter, loss, batch, blocks)
    monkeypatch.setattr(chunked, "REFERENCE_SCORES", 0)
    monkeypatch.setattr(chunked, "CHUNK_SCORES", 1 << 16)  # ~10 blocks a chunk
    got, grads = loss_and_grads(target, drafter, loss, batch, blocks)
    assert got == pytest.approx(plain, rel=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, plain_grads[name], rtol=1e-5, atol=1e-8, msg=name)


@pytest.mark.parametrize("length,anchors,measure", [(32768, 2048, True), (65536, 4096, False)])
def test_a_long_sample_trains_a_step_within_its_memory_plan(models, long_sample, length, anchors, measure):
    """A step on one long sample: finite loss, a gradient for every weight, every weight stepped; at 32,768
    tokens the peak tensor bytes (features, drafter forward and backward) against the plan (measuring
    every op costs 4x the step: 65,536 tokens are measured in docs/BENCHMARKS.md)."""
    config, target, drafter, cfg, loss = models
    batch = one_sample(length, seed=1)
    blocks = draw_blocks(batch, block_size=B, num_anchors=anchors, mask_token_id=MASK,
                         slot_weights=slot_weights(B, 7.0), seed=0, epoch=0)
    assert blocks.num_blocks == anchors
    rows = anchors * B
    plan = MemoryPlan(target_sizes(config), DrafterSizes.from_target(config, layers=2, features=1),
                      MemorySetup(dtype_bytes=4, num_anchors=anchors, attention="reference",
                                  **loss_setup(resolve_run(cfg))))
    # the plain reference would keep rows x length scores
    assert reference_attention.runs_chunked(plan.drafter, plan.setup, rows * length)
    estimate = max(plan.target_phase(length), plan.drafter_phase(length, rows, rows * length))
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    if measure:
        measured, (value, grads) = measure_peak_tensor_bytes(loss_and_grads, target, drafter, loss, batch, blocks)
        # the plan counts one chunk of CHUNK_SCORES in flight; a sliding layer's chunks are far smaller
        in_flight = chunked.CHUNK_SCORES * (8 + 2 * 4)
        assert measured <= estimate <= 1.02 * measured + in_flight, (estimate, measured)
    else:  # a causal target: the long sample's features are those of this one
        value, grads = loss_and_grads(target, drafter, loss, batch, blocks, long_sample[1][:length])
    # the plain reference: 17 bytes per (row, key) pair and layer, 36 GB for 2 layers at 32K x 2,048, 146 GB at
    # 64K x 4,096
    assert estimate < 2**30
    opt.step()
    assert torch.isfinite(torch.tensor(value)) and value > 0
    for name, p in drafter.named_parameters():
        assert torch.isfinite(grads[name]).all() and grads[name].abs().sum() > 0, name
        assert not torch.equal(p.detach(), before[name]), name  # the optimizer stepped every weight
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(before[name])  # the module's drafter, for the other tests


def test_a_long_sample_decodes_as_it_trains(models, long_sample):
    """65,536 tokens, the last 48 supervised: the eval walk (blocks at every anchor, the chunked reference)
    runs, and at every one of its anchors the decoding forward (`draft_hidden`, a DrafterCache that holds
    every context row before the anchor, fed as decoding feeds it) gives the batched forward's states."""
    _, _, drafter, _, loss = models
    batch, features = long_sample
    length, tail = batch.num_tokens, 48
    mask = torch.zeros(length, dtype=torch.bool)
    mask[-tail:] = True
    batch = dataclasses.replace(batch, loss_mask=mask)
    chunks = every_anchor(batch, B)
    forward = block_scorer(drafter, loss, drafter.lm_head, mask_token_id=MASK, slot_weights=slot_weights(B, 7.0))
    stats = score_and_walk(forward, batch, features, chunks, block_size=B)
    assert stats.turns == 1 and stats.tokens == tail - 1 and 1 <= stats.blocks <= tail - 1
    assert stats.anchors == chunks[0].num_blocks == tail - 1
    anchors = chunks[0]
    with torch.no_grad():
        blocks = Blocks.build(anchors, batch, MASK, slot_weights(B, 7.0))
        batched = drafter(batch, features, blocks).view(-1, B, drafter.config.hidden_size)
        cache = DrafterCache(drafter, length + B)
        for j, a in enumerate(anchors.block_anchor.tolist()):
            hidden = drafter.draft_hidden(cache, features[cache.length:a], int(batch.input_ids[a]))
            torch.testing.assert_close(hidden, batched[j, 1:], rtol=1e-4, atol=1e-5)
    assert cache.length == length - 2  # the last anchor's context
