"""Write the real benchmark's prompts (SmolLM2-135M-Instruct as the target; prompts from the Python
standard library): `benchmarks/smollm2/prompts.jsonl` and `heldout_prompts.jsonl`.

    python launch/build_real_bench.py [--out DIR] [--seed N] [--heldout-share F]

The same seed and Python version give the same files. Regenerating them with the target is a
separate, resumable run (hours on one CPU thread); the command is in the assets' README.md.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from dflash.bench_real import ASSETS
from dflash.errors import exit_on_user_error
from dflash.options import number


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ASSETS, help=f"output folder (default: {ASSETS})")
    p.add_argument("--seed", type=number(int, minimum=0), default=0, help="seed of every choice (default: 0)")
    p.add_argument("--heldout-share", type=number(float, minimum=0.0, maximum=0.5), default=0.05,
                   help="share of the prompts' sources held out (default: 0.05)")
    return p.parse_args(argv)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    from dflash.bench_real.prompts import build_prompts, record, split

    train, heldout = split(build_prompts(args.seed), args.heldout_share, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, prompts in (("prompts.jsonl", train), ("heldout_prompts.jsonl", heldout)):
        with open(args.out / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(record(p, args.seed), ensure_ascii=False) + "\n" for p in prompts)
        kinds = Counter(p.kind for p in prompts)
        print(f"{args.out / name}: {len(prompts)} conversations ({', '.join(f'{k} {n}' for k, n in kinds.items())})")


if __name__ == "__main__":
    main()
