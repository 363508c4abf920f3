"""FLOPs of the target feature forward per micro-batch: packed vs real tokens vs padded.

1. Counted (analytic, `target_forward_flops`) for Qwen3-8B with the default taps on micro-batches
   of the seed-like lengths in a full shuffle under a token budget: packed micro-batches (sum of
   lengths <= budget) against the same samples run one by one (the real-token cost), and padded
   micro-batches (count x longest <= budget) against their real tokens.
2. Measured (`FlopCounterMode` on real forwards of a tiny Qwen3 through `TargetModel.features`)
   for a few seed-like packed micro-batches: packed forward against each sample run alone.

Run: python launch/count_target_flops.py [--lengths LENGTHS.npy]
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash.data.batch import PackedBatch
from dflash.data.seed_lengths import SEED_TOKEN_BUDGET, seed_like_lengths
from dflash.options import number
from dflash.sizing.flops import measure_flops, target_forward_flops
from dflash.target.model import TargetModel
from dflash.target.spec import load_target_spec
from dflash.target.taps import default_target_layer_ids


def greedy(lengths, budget, cost):
    """Consecutive micro-batches of the given order, each as large as `cost` allows."""
    batches, current = [], []
    for n in lengths:
        if current and cost(current + [n]) > budget:
            batches.append(current)
            current = []
        current.append(int(n))
    if current:
        batches.append(current)
    return batches


def tiny_packed(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    return PackedBatch(torch.randint(0, vocab, (int(cu[-1]),), generator=g), torch.ones(int(cu[-1]), dtype=torch.bool),
                       torch.cat([torch.arange(n) for n in lengths]), cu, cu.clone(), max(lengths),
                       torch.arange(len(lengths)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", help=".npy array of sample lengths (default: the built-in seed-like lengths)")
    ap.add_argument("--budget", type=number(int, minimum=1), default=SEED_TOKEN_BUDGET, help="tokens per micro-batch")
    ap.add_argument("--samples", type=number(int, minimum=1), default=200_000,
                    help="shuffled samples counted analytically")
    ap.add_argument("--measure", type=number(int, minimum=0), default=2,
                    help="micro-batches measured with FlopCounterMode")
    ap.add_argument("--seed", type=number(int, minimum=0), default=0)
    args = ap.parse_args()

    if args.lengths:
        lengths, source = np.load(args.lengths), args.lengths
    else:
        lengths, source = seed_like_lengths(), "dflash.data.seed_lengths.seed_like_lengths()"
    order = np.random.default_rng(args.seed).permutation(len(lengths))[: args.samples]
    shuffled = lengths[order].tolist()

    config = load_target_spec("qwen3-8b", bare_presets=True).config
    taps = default_target_layer_ids(config.num_hidden_layers)
    layers = max(taps) + 1
    print(f"lengths: {source}; {len(shuffled)} samples in a full shuffle; budget {args.budget} tokens")
    print(f"Qwen3-8B, taps {taps}: {layers} of {config.num_hidden_layers} layers run, no lm_head")

    packed = greedy(shuffled, args.budget, sum)
    padded = greedy(shuffled, args.budget, lambda b: len(b) * max(b))
    for name, batches, layout in (("packed", packed, "packed"), ("padded", padded, "padded")):
        computed = sum(target_forward_flops(config, b, layers, layout) for b in batches)
        real = sum(target_forward_flops(config, [n], layers) for b in batches for n in b)
        print(f"{name:7s} {len(batches):6d} micro-batches, {computed / len(batches) / 1e12:8.1f} TFLOP each; "
              f"computed / real-token FLOPs = {computed / real:.6f}")

    torch.manual_seed(0)
    tiny = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=8192)
    target = TargetModel(AutoModelForCausalLM.from_config(tiny).float(), [1, 2])
    for i, b in enumerate(packed[: args.measure]):
        measured, _ = measure_flops(target.features, tiny_packed(b, tiny.vocab_size, i))
        alone = sum(measure_flops(target.features, tiny_packed([n], tiny.vocab_size, i))[0] for n in b)
        print(f"measured (tiny Qwen3, FlopCounterMode) micro-batch {i}: {len(b)} samples, {sum(b)} tokens, "
              f"longest {max(b)}: packed {measured} FLOPs, samples alone {alone}, "
              f"ratio {measured / alone:.6f}, analytic {target_forward_flops(tiny, b, 3)}")


if __name__ == "__main__":
    main()
