"""The loss terms (D-PACE, KL, LK) inside the chunked pass against plain PyTorch on full logits
(autograd for the gradients), their memory, the target logits once per position, and --loss."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dflash.models import BlockLoss, chunked_loss
from dflash.objective.anchors import Anchors
from dflash.objective.terms import (
    CU_SEQLENS,
    TARGET_STATES,
    DPaceTerm,
    KLTerm,
    LKTerm,
    block_chunk_rows,
    build_terms,
    parse_recipe,
)
from dflash.sizing.tensor_bytes import measure_peak_tensor_bytes

B = 5  # block size: 4 scored slots per block


def problem(vocab=300, hidden=16, lengths=(23, 17), anchors_per_sample=6, seed=0):
    """Scored drafter rows of sorted-anchor blocks over a packed batch, the target's final states
    and the shared lm_head."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq, anchor = [], []
    for s, n in enumerate(lengths):
        a = torch.randperm(n - 1, generator=g)[:anchors_per_sample].sort().values
        seq += [s] * len(a)
        anchor += a.tolist()
    anchors = Anchors(torch.tensor(seq, dtype=torch.int32), torch.tensor(anchor, dtype=torch.int32), B, 0)
    nb = len(seq)
    length = (cu[1:] - cu[:-1])[anchors.block_seq.long()]
    inside = anchors.block_anchor[:, None] + torch.arange(1, B)[None, :] < length[:, None]
    valid = inside & (torch.rand(nb, B - 1, generator=g) > 0.2)
    weights = torch.exp(-torch.arange(B - 1) / 3.0)[None, :] * valid
    blocks = SimpleNamespace(anchors=anchors, block_size=B, labels=torch.randint(0, vocab, (nb, B - 1), generator=g),
                             valid=valid, weights=weights.float(), num_blocks=nb)
    h = torch.randn(nb * (B - 1), hidden, generator=g).requires_grad_()
    lm_head = torch.randn(vocab, hidden, generator=g) * 0.3
    states = torch.randn(int(cu[-1]), hidden, generator=g)
    return h, lm_head, blocks, {TARGET_STATES: states, CU_SEQLENS: cu}


def target_logits_of_rows(blocks, context, lm_head):
    """Per row (block j, slot k), the target's logits at the position before the label, a loop."""
    cu, states = context[CU_SEQLENS], context[TARGET_STATES]
    rows = []
    for j in range(blocks.labels.shape[0]):
        for k in range(1, B):
            pos = int(cu[blocks.anchors.block_seq[j]]) + int(blocks.anchors.block_anchor[j]) + k - 1
            rows.append(states[min(pos, states.shape[0] - 1)] @ lm_head.t())
    return torch.stack(rows)


def dpace_reference(logits, blocks, alpha):
    ce = F.cross_entropy(logits, blocks.labels.reshape(-1), reduction="none")
    q, valid = torch.exp(-ce).detach().view(-1, B - 1), blocks.valid.float()
    weights = torch.zeros_like(q)
    for j in range(q.shape[0]):
        prefix, survival = 1.0, []
        for k in range(B - 1):
            prefix = prefix * ((1 - alpha) * q[j, k] + alpha) if valid[j, k] else prefix
            survival.append(prefix * valid[j, k])
        for k in range(B - 1):
            weights[j, k] = valid[j, k] * sum(survival[k:])
    return (weights.view(-1) * ce).sum()


def kl_reference(logits, blocks, context, lm_head, t):
    p = torch.softmax(target_logits_of_rows(blocks, context, lm_head) / t, -1)
    kl = F.kl_div(torch.log_softmax(logits / t, -1), p, reduction="none").sum(-1)
    return (blocks.weights.reshape(-1) * kl).sum()


def lk_reference(logits, blocks, context, lm_head, t, eps=1e-5):
    p = torch.softmax(target_logits_of_rows(blocks, context, lm_head) / t, -1)
    alpha = torch.minimum(p, torch.softmax(logits / t, -1)).sum(-1)
    return (blocks.weights.reshape(-1) * -torch.log(alpha.clamp_min(eps))).sum()


def run_pass(h, lm_head, blocks, context, term, chunk, ce_weight=1.0):
    term.start(blocks, context)
    loss, _, _, parts = chunked_loss(h, lm_head, blocks.labels.reshape(-1), blocks.weights.reshape(-1), chunk,
                                     ce_weight=ce_weight, terms=(term,))
    (grad,) = torch.autograd.grad(2.0 * loss, h)
    return loss, grad, parts


def reference(h, lm_head, blocks, ce_weight, weight, fn):
    logits = h @ lm_head.t()
    ce = (F.cross_entropy(logits, blocks.labels.reshape(-1), reduction="none") * blocks.weights.reshape(-1)).sum()
    value = fn(logits)
    ref = ce_weight * ce + weight * value
    (grad,) = torch.autograd.grad(2.0 * ref, h)
    return ref, grad, value


@pytest.mark.parametrize("chunk", [4, 12, 1000])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_dpace_matches_full_logits(chunk, alpha):
    h, lm_head, blocks, context = problem()
    loss, grad, parts = run_pass(h, lm_head, blocks, context, DPaceTerm(0.7, alpha=alpha), chunk, ce_weight=0.3)
    ref, ref_grad, value = reference(h, lm_head, blocks, 0.3, 0.7, lambda z: dpace_reference(z, blocks, alpha))
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(parts[1], value.detach(), rtol=1e-5, atol=1e-4)


def test_dpace_refuses_a_chunk_that_splits_a_block():
    h, lm_head, blocks, context = problem()
    with pytest.raises(ValueError, match="whole blocks"):
        run_pass(h, lm_head, blocks, context, DPaceTerm(1.0), 7)
    assert block_chunk_rows(1024, 16) == 1020 and block_chunk_rows(3, 16) == 15


@pytest.mark.parametrize("chunk", [3, 11, 1000])
@pytest.mark.parametrize("t", [1.0, 2.0])
@pytest.mark.parametrize("kind", ["kl", "lk"])
def test_target_distribution_terms_match_full_logits(kind, t, chunk):
    h, lm_head, blocks, context = problem()
    term = (KLTerm if kind == "kl" else LKTerm)(0.6, temperature=t, lm_head=lm_head)
    fn = kl_reference if kind == "kl" else lk_reference
    ce_weight = 0.0 if kind == "kl" else 1.0
    loss, grad, parts = run_pass(h, lm_head, blocks, context, term, chunk, ce_weight=ce_weight)
    ref, ref_grad, value = reference(h, lm_head, blocks, ce_weight, 0.6, lambda z: fn(z, blocks, context, lm_head, t))
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(parts[1], value.detach(), rtol=1e-5, atol=1e-4)


def test_kl_to_the_target_itself_is_zero_and_lk_too():
    """A drafter whose rows are the target's own states: KL 0 with gradient 0, acceptance 1 (LK 0; min(p, q)
    has a kink at p = q, so its gradient there is a subgradient, not checked)."""
    h, lm_head, blocks, context = problem()
    term = KLTerm(1.0, lm_head=lm_head)
    term.start(blocks, context)
    same = context[TARGET_STATES][term.positions].clone().requires_grad_()
    for t in (KLTerm(1.0, lm_head=lm_head), LKTerm(1.0, lm_head=lm_head)):
        loss, grad, _ = run_pass(same, lm_head, blocks, context, t, 6, ce_weight=0.0)
        assert abs(float(loss.detach())) < 1e-4
        assert t.name == "lk" or grad.abs().max() < 1e-4


def test_target_logits_once_per_position_not_per_row():
    """Overlapping blocks score each position up to B-1 times; the target's logits are computed for
    each distinct position of a chunk once (twice at most where two chunks meet)."""
    h, lm_head, blocks, context = problem(lengths=(60, 50), anchors_per_sample=40)
    computed = []

    class Counting(KLTerm):
        def target_probs(self, lo, hi):
            probs, inverse = super().target_probs(lo, hi)
            computed.append(probs.shape[0])
            return probs, inverse

    chunk = 32
    run_pass(h, lm_head, blocks, context, Counting(1.0, lm_head=lm_head), chunk)
    rows, chunks = h.shape[0], len(computed)
    distinct = torch.unique(_positions(blocks, context)).numel()
    assert rows > 2.5 * distinct  # the blocks overlap: scoring per row would compute 2.5x more
    assert sum(computed) <= distinct + (chunks - 1) * (B - 2)


def _positions(blocks, context):
    term = KLTerm(1.0, lm_head=torch.zeros(1, 1))
    term.start(blocks, context)
    return term.positions


@pytest.mark.parametrize("kind", ["dpace", "kl", "lk"])
def test_term_memory_is_its_vocab_buffers_per_chunk(kind):
    """Peak memory of the pass with a term: the chunk's logits plus the term's vocab_buffers (chunk x
    vocab float32 each), whatever the number of rows."""
    vocab, chunk = 4096, 24

    def peak(per_sample):
        h, lm_head, blocks, context = problem(vocab=vocab, lengths=(400, 300), anchors_per_sample=per_sample)
        term = build_terms({kind: 1.0}, lm_head=lm_head)[0]

        def step():
            term.start(blocks, context)
            loss, *_ = chunked_loss(h, lm_head, blocks.labels.reshape(-1), blocks.weights.reshape(-1), chunk,
                                    terms=(term,))
            loss.backward()

        return measure_peak_tensor_bytes(step)[0], term.vocab_buffers

    (small, _), (large, buffers) = peak(20), peak(200)
    per_buffer = chunk * vocab * 4
    assert large < (1 + buffers) * per_buffer * 1.15 + 2 ** 20  # + rows x hidden and the inputs
    assert large > buffers * per_buffer  # the count is not padded
    assert large - small < per_buffer / 2  # it does not grow with the rows


def test_recipe_parsing():
    assert parse_recipe("ce=1,dpace=0.5") == {"ce": 1.0, "dpace": 0.5}
    assert parse_recipe("kl") == {"kl": 1.0}
    for bad, why in (("ce=1,foo=2", "unknown part 'foo'"), ("ce=1,ce=2", "twice"), ("kl=x", "a number"),
                     ("kl=-1", ">= 0"), ("ce=0", "weighs nothing"), ("kl=nan", "finite")):
        with pytest.raises(ValueError, match=why):
            parse_recipe(bad)
    lm_head = torch.zeros(3, 2)
    terms = build_terms({"ce": 1.0, "dpace": 0.5, "kl": 0.0, "lk": 2.0},
                        SimpleNamespace(dpace_alpha=0.3, distill_temperature=2.0), lm_head=lm_head)
    assert [(t.name, t.weight) for t in terms] == [("dpace", 0.5), ("lk", 2.0)]
    assert terms[0].alpha == 0.3 and terms[1].temperature == 2.0 and terms[1].lm_head is lm_head
    assert BlockLoss(terms=terms).vocab_buffers == 1 + 1 + 2


def test_target_terms_say_what_they_need():
    h, lm_head, blocks, context = problem()
    with pytest.raises(ValueError, match="final states"):
        KLTerm(1.0, lm_head=lm_head).start(blocks, {})
    with pytest.raises(ValueError, match="lm_head"):
        LKTerm(1.0).start(blocks, context)
    with pytest.raises(ValueError, match="temperature"):
        KLTerm(1.0, temperature=0.0)
    with pytest.raises(ValueError, match="alpha"):
        DPaceTerm(1.0, alpha=1.5)
