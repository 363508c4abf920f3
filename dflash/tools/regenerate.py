"""Regenerate a conversation dataset with the target model (the data a DFlash drafter learns from).

    python launch/regenerate.py --target MODEL --input prompts.jsonl --output out.jsonl

Every assistant turn is replaced by the target's own response to the turns before it (a
conversation that ends with a user turn gets one response). Greedy by default. Rerunning the same
command resumes: conversations already in --output are skipped, matched by content, so after an
edit of --input the changed ones are regenerated and those no longer in it dropped. One run at a
time writes an --output; one made of another input file or with other settings is refused. The
output is JSONL in the `messages` form that launch/prepare_data.py reads, with a `meta` field per
line.
"""
from __future__ import annotations

import argparse
import signal
import sys

from dflash.errors import exit_on_user_error
from dflash.options import number
from dflash.regenerate import BACKENDS, DTYPES, RegenerateConfig, regenerate, summary


def parse_args(argv=None) -> RegenerateConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True,
                   help="the target (its tokenizer has a chat template): a Hugging Face model folder, a Hub id "
                        "(ORG/NAME) or a .gguf file or a folder holding one")
    p.add_argument("--input", required=True,
                   help="conversations ({'messages': [...]} or ShareGPT {'conversations': [...]}): a JSONL, JSON, "
                        "parquet or Arrow file, a folder of parquet shards, or a datasets save_to_disk folder")
    p.add_argument("--split", default=None,
                   help="the split to read where --input holds several (a Hub folder's train-*/test-* files, a "
                        "DatasetDict)")
    p.add_argument("--messages-field", default=None,
                   help="the input's column of turns (default: messages, else conversations)")
    p.add_argument("--output", required=True,
                   help="output JSONL; if it exists, the run resumes it (conversations matched by content)")
    p.add_argument("--max-new-tokens", type=number(int, minimum=1), default=2048,
                   help="limit per assistant turn (default: 2048)")
    p.add_argument("--temperature", type=number(float, minimum=0), default=0.0,
                   help="0 = greedy (default); > 0 samples at this temperature")
    p.add_argument("--seed", type=number(int, minimum=0), default=None,
                   help="sampling seed, recorded in meta (default: 0 when sampling)")
    p.add_argument("--batch-size", type=number(int, minimum=1), default=16,
                   help="conversations per generation batch (default: 16)")
    p.add_argument("--keep-thinking", action="store_true",
                   help="keep <think>...</think> in stored responses "
                        "(default: strip it, as Qwen3 templates do for history)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip unusable input lines and report counts and reasons, instead of stopping at the first")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="generation engine: auto = vllm if installed and a GPU is present, else hf (default: auto)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="model dtype: auto = bfloat16 on GPU, float32 on CPU")
    p.add_argument("--limit", type=number(int, minimum=1), default=None,
                   help="regenerate only the first N valid conversations")
    a = p.parse_args(argv)
    return RegenerateConfig(
        target=a.target, input=a.input, output=a.output, max_new_tokens=a.max_new_tokens,
        temperature=a.temperature, seed=a.seed, batch_size=a.batch_size, keep_thinking=a.keep_thinking,
        skip_bad=a.skip_bad, backend=a.backend, dtype=a.dtype, limit=a.limit, messages_field=a.messages_field,
        split=a.split,
    )


@exit_on_user_error
def main(argv=None):
    cfg = parse_args(argv)

    def terminate(signum, frame):
        raise KeyboardInterrupt  # `kill`: stop as after Ctrl-C, the lock released

    signal.signal(signal.SIGTERM, terminate)
    try:
        stats = regenerate(cfg)
    except KeyboardInterrupt:
        print("\ninterrupted: the lines written so far are complete; rerun the same command to resume",
              file=sys.stderr)
        sys.exit(130)
    print(summary(stats, cfg.output))


if __name__ == "__main__":
    main()
