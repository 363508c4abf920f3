"""Random samples as packed and padded batches, and the per-sample Hugging Face features, shared by
the target tests (test_target, test_target_families)."""
import numpy as np
import torch

from dflash.data.batch import PackedBatch, PaddedBatch

VOCAB = 300


def make_batches(lengths, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    packed = PackedBatch(
        input_ids=torch.cat(samples),
        loss_mask=torch.ones(int(cu[-1]), dtype=torch.bool),
        position_ids=torch.cat([torch.arange(n) for n in lengths]),
        cu_seqlens=cu,
        cu_seqlens_cpu=cu.clone(),
        max_seqlen=max(lengths),
        sample_ids=torch.arange(len(lengths)),
    )
    S, L = len(lengths), max(lengths)
    ids = torch.zeros(S, L, dtype=torch.long)
    mask = torch.zeros(S, L, dtype=torch.bool)
    pos = torch.zeros(S, L, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s)], mask[i, : len(s)], pos[i, : len(s)] = s, True, torch.arange(len(s))
    padded = PaddedBatch(ids, mask, mask.clone(), pos, torch.tensor(lengths), torch.arange(S))
    return samples, packed, padded


def reference_features(reference, samples, taps):
    """Per-sample, unpacked Hugging Face forward: hidden_states[id + 1] concatenated."""
    out = []
    with torch.no_grad():
        for s in samples:
            hs = reference(s[None], output_hidden_states=True).hidden_states
            out.append(torch.cat([hs[i + 1][0] for i in taps], dim=-1))
    return torch.cat(out)
