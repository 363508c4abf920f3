"""Write the real benchmark's prompts (SmolLM2-135M-Instruct as the target; prompts from the Python
standard library): `benchmarks/smollm2/prompts.jsonl` and `heldout_prompts.jsonl`.

    python launch/build_real_bench.py [--out DIR] [--seed N] [--heldout-share F]

The same seed and Python version give the same files. Regenerating them with the target is a
separate, resumable run (hours on one CPU thread); the command is in the assets' README.md.
One build writes --out at a time; it replaces only files it wrote (each line records `built_with`),
and the rest of the folder (the regenerated data, a drafter) is left as it is.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from dflash.bench_real import ASSETS
from dflash.errors import UserError, exit_on_user_error
from dflash.options import number


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ASSETS, help=f"output folder (default: {ASSETS})")
    p.add_argument("--seed", type=number(int, minimum=0), default=0, help="seed of every choice (default: 0)")
    p.add_argument("--heldout-share", type=number(float, minimum=0.0, maximum=0.5), default=0.05,
                   help="share of the prompts' sources held out (default: 0.05)")
    return p.parse_args(argv)


OUTPUTS = ("prompts.jsonl", "heldout_prompts.jsonl")


def check_own_file(path: Path) -> None:
    """Refuse to replace `path` unless a build wrote it (its first line records `built_with`)."""
    if not path.exists():
        return
    try:
        with open(path, encoding="utf-8") as f:
            ours = "built_with" in json.loads(f.readline() or "{}")
    except (OSError, ValueError, TypeError):
        ours = False
    if not ours and path.stat().st_size:
        raise UserError(f"--out {path.parent}: holds {path.name}, which build_real_bench.py did not write (its lines "
                        "record no built_with); move it away, or choose another --out")


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out}: exists and is not a folder; give a folder to write the prompts in")
    from dflash.partial import OutputLock, replace_file

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with OutputLock(args.out, flag="--out", what="build"):  # before any work: a second build stops at once
        for name in OUTPUTS:
            check_own_file(args.out / name)
        from dflash.bench_real.prompts import build_prompts, record, split

        train, heldout = split(build_prompts(args.seed), args.heldout_share, args.seed)
        args.out.mkdir(parents=True, exist_ok=True)
        for name, prompts in zip(OUTPUTS, (train, heldout), strict=True):
            replace_file(args.out / name, ((json.dumps(record(p, args.seed), ensure_ascii=False) + "\n").encode()
                                           for p in prompts))
            kinds = Counter(p.kind for p in prompts)
            print(f"{args.out / name}: {len(prompts)} conversations "
                  f"({', '.join(f'{k} {n}' for k, n in kinds.items())})")


if __name__ == "__main__":
    main()
