#!/usr/bin/env python
"""Tokenize conversations into a dflash token store.

--input is a JSONL, JSON, parquet or Arrow file, a folder of parquet shards, or a datasets
save_to_disk folder (the format is read from the content). Each row holds
{"messages": [{"role": ..., "content": ...}, ...]}, the ShareGPT form
{"conversations": [{"from": ..., "value": ...}, ...]}, or turns in the column --messages-field
names. The tokenizer's chat template renders each conversation; the loss mask covers the
assistant turns only. Several processes tokenize a large input (--num-proc).

Example:
  python launch/prepare_data.py --input data.jsonl --tokenizer path/to/model --output data/store
  python launch/prepare_data.py --input hub_dataset/data --tokenizer path/to/model --output data/store
"""
import argparse

from dflash.data.prepare import OVERLONG, prepare_jsonl
from dflash.errors import UserError, exit_on_user_error
from dflash.options import number


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True,
                   help="conversations: a JSONL, JSON, parquet or Arrow file, a folder of parquet shards, or a "
                        "datasets save_to_disk folder")
    p.add_argument("--messages-field", default=None,
                   help="the column holding each conversation's turns (default: messages, else conversations)")
    p.add_argument("--split", default=None,
                   help="the split to read where --input holds several (a Hub folder's train-*/test-* files, a "
                        "DatasetDict); one of several is never chosen for you")
    p.add_argument("--num-proc", type=number(int, minimum=1), default=None,
                   help="tokenizing processes (default: one per 16 MiB of input, up to the CPUs available)")
    p.add_argument("--tokenizer", required=True,
                   help="local Hugging Face tokenizer (or model) folder with a chat template, or a .gguf model file")
    p.add_argument("--output", required=True, help="folder to create for the token store")
    p.add_argument("--max-length", type=number(int, minimum=1), default=None,
                   help="longest sample in tokens (default: no limit)")
    p.add_argument("--overlong", choices=OVERLONG, default="truncate",
                   help="what to do with samples longer than --max-length (counted in the summary either way)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip bad lines (rows) and report them by reason instead of stopping at the first one")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --output if it is a token store made by dflash (any other folder is refused)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    try:
        summary = prepare_jsonl(args.input, args.tokenizer, args.output, max_length=args.max_length,
                                overlong=args.overlong, skip_bad=args.skip_bad, overwrite=args.overwrite,
                                progress=not args.no_progress, messages_field=args.messages_field,
                                num_proc=args.num_proc, split=args.split)
    except KeyboardInterrupt:  # the store is written all or nothing: a stop leaves nothing to clean
        raise UserError(f"stopped (Ctrl-C) before the store was complete; nothing was written to {args.output}") \
            from None
    print(summary.text())


if __name__ == "__main__":
    main()
