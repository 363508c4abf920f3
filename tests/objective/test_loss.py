"""Chunked weighted cross-entropy and acceptance statistics against direct computations."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.models import acceptance_stats, chunked_weighted_ce
from dflash.sizing.tensor_bytes import measure_peak_tensor_bytes


def inputs(n, vocab, hidden, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    w = torch.rand(n, generator=g) * (torch.rand(n, generator=g) > 0.3)  # some rows weigh 0
    return h, weight, labels, w


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_ce_matches_full_logits(chunk):
    h, weight, labels, w = inputs(37, 300, 16)
    loss, preds, _ = chunked_weighted_ce(h, weight, labels, w, chunk)
    (grad,) = torch.autograd.grad(3.0 * loss, h)
    logits = h @ weight.t()
    ref = (F.cross_entropy(logits, labels, reduction="none") * w).sum()
    (ref_grad,) = torch.autograd.grad(3.0 * ref, h)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(preds, logits.argmax(-1))


def test_chunked_ce_label_logprobs_at_temperatures():
    h, weight, labels, w = inputs(37, 300, 16)
    temperatures = (0.3, 1.0, 2.5)
    loss, preds, logq = chunked_weighted_ce(h, weight, labels, w, 7, temperatures)
    logits = (h @ weight.t()).detach()
    ref = torch.stack([torch.log_softmax(logits / t, -1).gather(1, labels[:, None]).squeeze(1) for t in temperatures],
                      dim=1)
    torch.testing.assert_close(logq, ref, rtol=1e-5, atol=1e-5)
    assert not logq.requires_grad
    # the loss and its gradient are those without temperatures
    torch.testing.assert_close(loss, chunked_weighted_ce(h, weight, labels, w, 7)[0])
    with pytest.raises(ValueError, match="> 0"):
        chunked_weighted_ce(h, weight, labels, w, 7, (0.0,))


def test_chunked_ce_bf16_close_to_fp32_reference():
    h, weight, labels, w = inputs(50, 500, 32, dtype=torch.bfloat16)
    loss, _, _ = chunked_weighted_ce(h, weight, labels, w, 16)
    ref = (F.cross_entropy((h.float() @ weight.float().t()), labels, reduction="none") * w).sum()
    torch.testing.assert_close(loss, ref.detach(), rtol=2e-2, atol=1e-2)


def test_frozen_lm_head_is_required():
    h, weight, labels, w = inputs(4, 10, 8)
    with pytest.raises(ValueError, match="frozen"):
        chunked_weighted_ce(h, weight.requires_grad_(), labels, w)


def test_chunked_ce_peak_memory_does_not_grow_with_rows():
    vocab, hidden, chunk = 4096, 16, 64

    def peak(n):
        h, weight, labels, w = inputs(n, vocab, hidden)

        def step():
            loss, _, _ = chunked_weighted_ce(h, weight, labels, w, chunk)
            loss.backward()

        return measure_peak_tensor_bytes(step)[0]

    small, large = peak(128), peak(1024)
    chunk_logits = chunk * vocab * 4
    assert large < 1.2 * chunk_logits + 1024 * hidden * 4 * 4  # one chunk of logits + O(rows x hidden)
    assert large - small < (1024 - 128) * hidden * 4 * 4  # growth is rows x hidden, not rows x vocab
    assert large < 1024 * vocab * 4 / 10  # far below full logits


def test_acceptance_stats():
    correct = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    tau_sum, slot_correct, slot_count = acceptance_stats(correct, valid)
    assert float(tau_sum) == (2 + 1) + (2 + 1) + (0 + 1) + (4 + 1)  # an invalid slot stops acceptance
    assert slot_correct.tolist() == [3, 4, 2, 3]
    assert slot_count.tolist() == [4, 4, 3, 3]


class _SquaredLSE:
    """A test term: the sum over scored rows of weight_r x logsumexp(logits_r)^2 (z-loss's shape)."""

    name, vocab_buffers = "zsq", 1

    def __init__(self, weight, row_weights):
        self.weight, self.row_weights = weight, row_weights

    def start(self, blocks, context):
        pass

    def chunk(self, logits, lo, hi, need_grad):
        w = self.row_weights[lo:hi]
        lse = torch.logsumexp(logits, dim=-1)
        grad = (2 * w * lse)[:, None] * torch.softmax(logits, dim=-1) if need_grad else None
        return (w * lse**2).sum(), grad


@pytest.mark.parametrize("ce_weight", [1.0, 0.3, 0.0])
def test_terms_share_the_chunked_pass_with_their_weights_and_gradients(ce_weight):
    from dflash.models import chunked_loss

    h, weight, labels, w = inputs(37, 300, 16)
    term = _SquaredLSE(0.7, w)
    loss, preds, _, parts = chunked_loss(h, weight, labels, w, 7, ce_weight=ce_weight, terms=(term,))
    (grad,) = torch.autograd.grad(2.0 * loss, h)
    logits = h @ weight.t()
    ce = (F.cross_entropy(logits, labels, reduction="none") * w).sum()
    zsq = (w * torch.logsumexp(logits, -1) ** 2).sum()
    ref = ce_weight * ce + 0.7 * zsq
    (ref_grad,) = torch.autograd.grad(2.0 * ref, h)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(parts, torch.stack([ce, zsq]).detach(), rtol=1e-5, atol=1e-4)
    assert torch.equal(preds, logits.argmax(-1))


def test_block_loss_names_its_parts_and_refuses_an_empty_objective():
    from dflash.models import BlockLoss

    with pytest.raises(ValueError, match="empty"):
        BlockLoss(ce_weight=0.0)
    with pytest.raises(ValueError, match="distinct"):
        BlockLoss(terms=(_SquaredLSE(1.0, None), _SquaredLSE(1.0, None)))
    assert BlockLoss(terms=(_SquaredLSE(1.0, None),)).vocab_buffers == 2
