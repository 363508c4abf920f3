"""Re-create the built-in demo assets: tokenizer, tiny Qwen3 target, prompts, regenerated data.

    python launch/build_demo.py [--out DIR] [--seed N] [--steps N]

Defaults rebuild `dflash/demo/assets/` in place (a few minutes on a laptop CPU).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dflash.demo import ASSETS
from dflash.errors import UserError, exit_on_user_error
from dflash.options import number


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ASSETS, help=f"output folder (default: {ASSETS})")
    p.add_argument("--seed", type=number(int, minimum=0), default=0,
                   help="seed for the corpus, prompts and training (default: 0)")
    p.add_argument("--steps", type=number(int, minimum=1), default=300,
                   help="training steps of the target (default: 300)")
    p.add_argument("--prompts", type=number(int, minimum=1), default=1000,
                   help="number of bundled prompts (default: 1000)")
    p.add_argument("--batch-size", type=number(int, minimum=1), default=16,
                   help="regeneration batch size (default: 16)")
    p.add_argument("--max-new-tokens", type=number(int, minimum=1), default=256,
                   help="regeneration limit per assistant turn (default: 256)")
    p.add_argument("--threads", type=number(int, minimum=1), default=2, help="CPU threads for torch (default: 2)")
    return p.parse_args(argv)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    for name in ("steps", "prompts", "batch_size", "max_new_tokens", "threads"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    from dflash.demo.build import build
    from dflash.regenerate import summary

    stats = build(args.out, seed=args.seed, steps=args.steps, n_prompts=args.prompts,
                  batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, threads=args.threads)
    print(summary(stats, str(args.out / "demo_data.jsonl")))


if __name__ == "__main__":
    main()
