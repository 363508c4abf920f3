"""Peak tensor memory of the chunked drafter loss (forward + backward) on the CPU.

Runs `chunked_weighted_ce` with a 150K-class lm_head for growing numbers of block rows and
prints the peak bytes of tensors created during the step (`measure_peak_tensor_bytes`), next to
the size full logits would have. The hidden size only sets the matmul cost, not the logits'
size, so a small one keeps the run short.

Run: python launch/measure_loss_memory.py [--vocab 151936] [--rows 1024 4096 8192]
"""
from __future__ import annotations

import argparse
import time

import torch

from dflash.objective.loss import DEFAULT_CHUNK_ROWS, chunked_weighted_ce
from dflash.options import number
from dflash.sizing.tensor_bytes import measure_peak_tensor_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=number(int, minimum=1), default=151936)
    ap.add_argument("--hidden", type=number(int, minimum=1), default=64)
    ap.add_argument("--rows", type=number(int, minimum=1), nargs="+", default=[1024, 4096, 8192],
                    help="scored block rows (one sample with 512 anchors and B=16 has 512*15 = 7680)")
    ap.add_argument("--chunk", type=number(int, minimum=1), default=DEFAULT_CHUNK_ROWS)
    args = ap.parse_args()

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=g) * 0.02
    mib = 2**20
    print(f"vocab {args.vocab}, hidden {args.hidden}, chunk {args.chunk} rows (fp32): "
          f"one chunk of logits = {args.chunk * args.vocab * 4 / mib:.1f} MiB")
    for n in args.rows:
        hidden = torch.randn(n, args.hidden, generator=g).requires_grad_()
        labels = torch.randint(0, args.vocab, (n,), generator=g)
        weights = torch.rand(n, generator=g)

        def step(hidden=hidden, labels=labels, weights=weights):
            loss, _, _ = chunked_weighted_ce(hidden, weight, labels, weights, args.chunk)
            loss.backward()

        start = time.perf_counter()
        peak, _ = measure_peak_tensor_bytes(step)
        print(f"rows {n:6d}: peak {peak / mib:8.1f} MiB (forward+backward); full logits would be "
              f"{n * args.vocab * 4 / mib:9.1f} MiB; {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
