"""Data preparation at scale: a synthetic set of N conversations with seed-like lengths, tokenized
into a token store by launch/prepare_data.py's code path; prints conversations/s, tokens/s, peak
memory, the store's size and the time the seed's 902K conversations would take on 32 cores.

    python launch/bench_prepare.py [--conversations 2000] [--num-proc 2] [--format parquet|jsonl]

Each conversation is one user turn and one assistant reply (a quarter and three quarters of a
length drawn from `seed_like_lengths`), of random tokens of the tokenizer's vocabulary; its
tokenized length is close to the drawn one. The extrapolation assumes the time per conversation
falls linearly with processes (tokenizing is independent per conversation; the one reading and
writing process is not counted apart): measure at the --num-proc of interest on an idle machine.
"""
from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from dflash.demo import TARGET
from dflash.errors import UserError, exit_on_user_error
from dflash.options import number

SEED_CONVERSATIONS = 902_000


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=str(TARGET), help="tokenizer folder with a chat template (default: demo)")
    p.add_argument("--conversations", type=number(int, minimum=1), default=2000,
                   help="synthetic conversations (default: 2000)")
    p.add_argument("--num-proc", type=number(int, minimum=1), default=2, help="tokenizing processes (default: 2)")
    p.add_argument("--format", choices=("parquet", "jsonl"), default="parquet", help="input format (default: parquet)")
    p.add_argument("--workdir", default=None, help="folder for the input and the store (default: a temporary one)")
    p.add_argument("--seed", type=number(int, minimum=0), default=0)
    return p.parse_args(argv)


def vocabulary_pieces(tokenizer) -> list[str]:
    special = set(tokenizer.all_special_ids)
    return [tokenizer.decode([i]) for i in range(len(tokenizer)) if i not in special]


def synthetic_rows(pieces: list[str], n: int, seed: int):
    """n conversations of random vocabulary tokens with seed-like lengths."""
    from dflash.data.seed_lengths import seed_like_lengths

    pieces = np.array(pieces, dtype=object)
    rng = np.random.default_rng(seed)
    for length in seed_like_lengths(n, seed):
        user = max(1, int(length) // 4)
        words = pieces[rng.integers(0, len(pieces), int(length))]
        yield {"messages": [{"role": "user", "content": "".join(words[:user])},
                            {"role": "assistant", "content": "".join(words[user:])}]}


def write_input(pieces: list[str], n: int, seed: int, path: Path, fmt: str) -> None:
    import datasets

    datasets.disable_progress_bars()
    # a tuple: datasets would shard a list in gen_kwargs into one generator call per element
    ds = datasets.Dataset.from_generator(synthetic_rows, gen_kwargs={"pieces": tuple(pieces), "n": n, "seed": seed},
                                         cache_dir=str(path.parent / "cache"))
    (ds.to_parquet if fmt == "parquet" else ds.to_json)(str(path))


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    if args.conversations < 1 or args.num_proc < 1:
        raise UserError("--conversations and --num-proc must be at least 1")
    from dflash.data.prepare import prepare_jsonl
    from dflash.data.tokenizing import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    with tempfile.TemporaryDirectory(prefix="bench_prepare_", dir=args.workdir) as tmp:
        src = Path(tmp) / f"conversations.{args.format}"
        write_input(vocabulary_pieces(tokenizer), args.conversations, args.seed, src, args.format)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        summary = prepare_jsonl(src, tokenizer, Path(tmp) / "store", num_proc=args.num_proc)
        seconds = time.perf_counter() - t0
        peak_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB -> MiB
        peak_child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**10
        store = folder_bytes(Path(tmp) / "store")
        n = summary.samples
        per_conv = seconds / n
        print(f"input: {args.conversations:,} conversations ({args.format}, {src.stat().st_size / 2**20:.1f} MiB), "
              f"tokenizer {args.tokenizer}, {args.num_proc} process(es)")
        print(f"prepared {n:,} samples, {summary.tokens:,} tokens in {seconds:.1f} s: "
              f"{n / seconds:,.0f} conversations/s, {summary.tokens / seconds:,.0f} tokens/s")
        print(f"peak memory: main process {peak_self:,.0f} MiB (before preparing: {before / 2**10:,.0f} MiB), "
              f"largest tokenizing process {peak_child:,.0f} MiB")
        print(f"store: {store / 2**20:,.1f} MiB ({store / max(summary.tokens, 1):.2f} bytes/token)")
        for cores in (args.num_proc, 32):
            t = per_conv * SEED_CONVERSATIONS * args.num_proc / cores
            print(f"extrapolated: {SEED_CONVERSATIONS:,} conversations on {cores} cores: {t / 60:,.1f} min "
                  f"(store about {store / n * SEED_CONVERSATIONS / 2**30:,.1f} GiB)")


if __name__ == "__main__":
    main()
