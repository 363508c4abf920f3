"""Packed target features of every target family against a Hugging Face forward of each sample alone.

Tiny random targets of each family (`dflash.demo.families`: MoE, hybrid Gated DeltaNet dense and
MoE, sliding window + sinks + MoE, MLA + MoE, and a dense control) run one packed micro-batch
through `TargetModel.features` with each attention backend; the reference runs every sample alone
through transformers' eager forward. Samples longer than the sliding window and of one token are
in the pack. Prints the relative error of the whole pack and of the worst token per family and
backend (the issue's bound: 1e-4 in float32).

Run: python launch/check_target_families.py [--backends auto,flex,triton] [--device cuda] [--json]
On a GPU, "auto" means the Triton kernels (windows: torch varlen) and the hybrid layers use
flash-linear-attention when installed and the dtype is bfloat16.
"""
from __future__ import annotations

import argparse
import json
import warnings

import torch


def pack(lengths, vocab, device, seed=0):
    from dflash.data.batch import PackedBatch

    g = torch.Generator().manual_seed(seed)
    samples = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    batch = PackedBatch(input_ids=torch.cat(samples), loss_mask=torch.ones(int(cu[-1]), dtype=torch.bool),
                        position_ids=torch.cat([torch.arange(n) for n in lengths]), cu_seqlens=cu,
                        cu_seqlens_cpu=cu.clone(), max_seqlen=max(lengths), sample_ids=torch.arange(len(lengths)))
    return samples, batch.to(device)


def check(family: str, backend: str, device: str, dtype: torch.dtype) -> dict:
    from dflash.demo.families import VOCAB, WINDOW, tiny_target
    from dflash.target.model import TargetModel

    model, reference = (tiny_target(family).to(device, dtype) for _ in range(2))
    taps = [0, 1, model.config.num_hidden_layers - 2]
    lengths = [3 * WINDOW + 5, 1, 17, 1, 2 * WINDOW, 40]
    samples, batch = pack(lengths, VOCAB, device)
    with torch.no_grad():
        want = torch.cat([torch.cat([hs[i + 1][0] for i in taps], -1) for hs in (
            reference(s[None].to(device), output_hidden_states=True).hidden_states for s in samples)]).float()
        got = TargetModel(model, taps, attention_backend=backend).features(batch).float()
    rows = (got - want).norm(dim=-1) / want.norm(dim=-1)
    return {"family": family, "backend": backend, "rel_error": ((got - want).norm() / want.norm()).item(),
            "worst_token": rows.max().item()}


def main(argv=None):
    from dflash.demo.families import CONFIGS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="auto,flex,triton", help="attention backends (default %(default)s)")
    ap.add_argument("--families", default=",".join(CONFIGS), help="families (default: all)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", action="store_true", help="print JSON records instead of the table")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    records = []
    for family in args.families.split(","):
        for backend in args.backends.split(","):
            try:
                records.append(check(family, backend, args.device, getattr(torch, args.dtype)))
            except NotImplementedError as e:  # a backend that does not serve the family
                records.append({"family": family, "backend": backend, "skipped": str(e)})
    if args.json:
        print(json.dumps(records, indent=1))
        return
    print("| family | backend | relative error | worst token |\n| --- | --- | --- | --- |")
    for r in records:
        if "skipped" in r:
            print(f"| {r['family']} | {r['backend']} | not served: {r['skipped'][:60]} | |")
        else:
            print(f"| {r['family']} | {r['backend']} | {r['rel_error']:.1e} | {r['worst_token']:.1e} |")


if __name__ == "__main__":
    main()
