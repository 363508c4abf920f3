"""Anchor sampling (candidates, skip rule, determinism) and same-position labels."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dflash.data.batch import PackedBatch
from dflash.models import block_tensors, sample_anchors, slot_weights

B = 4


def packed(samples, masks, sample_ids=None):
    lengths = [len(s) for s in samples]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    return PackedBatch(
        input_ids=torch.cat([torch.as_tensor(s) for s in samples]).long(),
        loss_mask=torch.cat([torch.as_tensor(m) for m in masks]).bool(),
        position_ids=torch.cat([torch.arange(n) for n in lengths]),
        cu_seqlens=cu,
        cu_seqlens_cpu=cu.clone(),
        max_seqlen=max(lengths),
        sample_ids=torch.as_tensor(sample_ids if sample_ids is not None else range(len(samples))),
    )


def anchors_of(batch, num_anchors=512, seed=0, epoch=0):
    return sample_anchors(batch.loss_mask, batch.cu_seqlens_cpu, batch.sample_ids,
                          block_size=B, num_anchors=num_anchors, seed=seed, epoch=epoch)


def anchors_by_sample(batch, anchors):
    sid = batch.sample_ids.tolist()
    out = {}
    for s, a in zip(anchors.block_seq.tolist(), anchors.block_anchor.tolist(), strict=True):
        out.setdefault(sid[s], []).append(a)
    return out


def random_sample(rng, n):
    mask = rng.random(n) < 0.7
    mask[: n // 4] = False  # a prompt
    return rng.integers(0, 100, n), mask


def test_anchors_are_candidates_drawn_without_replacement():
    rng = np.random.default_rng(0)
    samples, masks = zip(*[random_sample(rng, n) for n in (40, 90, 25)], strict=True)
    batch = packed(samples, masks)
    for num_anchors in (5, 512):
        anchors = anchors_of(batch, num_anchors=num_anchors)
        got = anchors_by_sample(batch, anchors)
        for s, m in enumerate(masks):
            candidates = [a for a in range(len(m) - 1) if m[a] and m[a + 1]]
            anchors = got[s]
            assert len(set(anchors)) == len(anchors) == min(num_anchors, len(candidates))
            assert set(anchors) <= set(candidates)
    assert sorted(got[1]) == [a for a in range(89) if masks[1][a] and masks[1][a + 1]]  # all of them


def test_samples_with_too_few_supervised_tokens_are_skipped_and_counted():
    just_enough = np.zeros(20, bool)
    just_enough[3 : 3 + 2 * B] = True  # exactly 2B supervised tokens: kept
    too_few = np.zeros(20, bool)
    too_few[3 : 2 + 2 * B] = True  # 2B - 1: skipped
    scattered = np.zeros(40, bool)
    scattered[::2] = True  # 20 supervised tokens, but no two in a row: no candidate
    batch = packed([np.arange(20), np.arange(20), np.arange(40)], [too_few, just_enough, scattered])
    anchors = anchors_of(batch)
    assert anchors.num_skipped == 2
    assert set(anchors.block_seq.tolist()) == {1}
    assert anchors.num_blocks == 2 * B - 1


def test_anchors_depend_only_on_seed_epoch_and_sample_id():
    rng = np.random.default_rng(1)
    samples, masks = zip(*[random_sample(rng, n) for n in (60, 80, 70)], strict=True)

    def draw(batch, epoch):
        return anchors_by_sample(batch, anchors_of(batch, num_anchors=6, seed=3, epoch=epoch))

    first = draw(packed(samples, masks, sample_ids=[10, 11, 12]), epoch=2)
    # The same samples in another order and another company draw the same anchors.
    other = packed([samples[2], np.arange(50), samples[0]], [masks[2], np.ones(50, bool), masks[0]],
                   sample_ids=[12, 99, 10])
    again = draw(other, epoch=2)
    assert first[10] == again[10] and first[12] == again[12]
    assert draw(packed(samples, masks, sample_ids=[10, 11, 12]), epoch=3) != first  # redrawn per epoch


def test_block_inputs_and_same_position_labels():
    rng = np.random.default_rng(2)
    samples, masks = zip(*[random_sample(rng, n) for n in (30, 45)], strict=True)
    batch = packed(samples, masks)
    anchors = anchors_of(batch, num_anchors=20)
    mask_id = 1000
    bt = block_tensors(anchors, batch, mask_id)
    ids, pos = bt.input_ids.view(-1, B), bt.position_ids.view(-1, B)
    for j, (s, a) in enumerate(zip(anchors.block_seq.tolist(), anchors.block_anchor.tolist(), strict=True)):
        tokens, m = samples[s], masks[s]
        assert ids[j].tolist() == [tokens[a]] + [mask_id] * (B - 1)
        assert pos[j].tolist() == [a + k for k in range(B)]
        for k in range(1, B):
            inside = a + k < len(tokens)
            assert bool(bt.label_valid[j, k - 1]) == (inside and bool(m[a + k]))
            if inside:
                assert int(bt.labels[j, k - 1]) == tokens[a + k]


def test_blocks_near_the_end_mask_labels_outside_the_sample():
    mask = np.ones(12, bool)
    batch = packed([np.arange(12), np.arange(100, 112)], [mask, mask])
    anchors = anchors_of(batch)
    bt = block_tensors(anchors, batch, mask_token_id=7)
    last = (anchors.block_seq == 0) & (anchors.block_anchor == 10)  # labels at 11 (inside), 12, 13 (outside)
    assert bt.label_valid[last].tolist() == [[True, False, False]]
    assert bt.labels[last][0, 0] == 11


@pytest.mark.parametrize("block_size,gamma", [(16, 7.0), (8, 4.0)])
def test_slot_weights(block_size, gamma):
    w = slot_weights(block_size, gamma)
    assert w.shape == (block_size - 1,)
    for k in range(1, block_size):
        assert math.isclose(float(w[k - 1]), math.exp(-(k - 1) / gamma), rel_tol=1e-6)
