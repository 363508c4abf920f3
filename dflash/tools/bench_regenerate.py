"""Regeneration throughput over batch sizes, on a fixed prompt subset (same code path as
launch/regenerate.py). Prints a markdown table of samples/s and generated tokens/s.

    python launch/bench_regenerate.py [--target DIR] [--input FILE] [--samples 64] [--batch-sizes 1,4,8,16,32]

Defaults: the bundled demo target and prompts, greedy, on whatever device the hf backend picks.
"""
from __future__ import annotations

import argparse
import tempfile

from dflash.demo import PROMPTS, TARGET
from dflash.errors import UserError, exit_on_user_error
from dflash.options import number


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(TARGET),
                   help="the target: a model folder, a Hub id or a .gguf file (default: the demo target)")
    p.add_argument("--input", default=str(PROMPTS), help="prompt JSONL (default: the demo prompts)")
    p.add_argument("--samples", type=number(int, minimum=1), default=64,
                   help="conversations per measurement (default: 64)")
    p.add_argument("--batch-sizes", default="1,4,8,16,32", help="comma-separated batch sizes (default: 1,4,8,16,32)")
    p.add_argument("--max-new-tokens", type=number(int, minimum=1), default=256,
                   help="limit per assistant turn (default: 256)")
    p.add_argument("--threads", type=number(int, minimum=1), default=2, help="CPU threads for torch (default: 2)")
    return p.parse_args(argv)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",")]
    except ValueError:
        raise UserError(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}") from None
    if args.samples < 1 or min(sizes) < 1 or args.threads < 1:
        raise UserError("--samples, --threads and every batch size must be at least 1")
    import torch

    from dflash.regenerate import RegenerateConfig, load_backend, load_tokenizer, regenerate

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        def run(batch_size, samples, name):
            cfg = RegenerateConfig(target=args.target, input=args.input, output=f"{tmp}/{name}.jsonl",
                                   max_new_tokens=args.max_new_tokens, batch_size=batch_size, limit=samples,
                                   backend="hf")
            return cfg, regenerate(cfg, backend=backend, tokenizer=tokenizer, progress=False)

        cfg = RegenerateConfig(target=args.target, input=args.input, output=f"{tmp}/x.jsonl", backend="hf")
        cfg.validate()
        tokenizer = load_tokenizer(args.target)
        backend = load_backend(cfg, tokenizer)
        run(2, 2, "warmup")
        print(f"backend {backend.name} on {backend.device}, {torch.get_num_threads()} threads, "
              f"{args.samples} conversations, greedy, max {args.max_new_tokens} new tokens per turn")
        print("| batch size | samples/s | tokens/s | seconds |")
        print("|---:|---:|---:|---:|")
        for b in sizes:
            _, s = run(b, args.samples, f"b{b}")
            print(f"| {b} | {s['written'] / s['seconds']:.2f} | {s['new_tokens'] / s['seconds']:.0f} "
                  f"| {s['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
