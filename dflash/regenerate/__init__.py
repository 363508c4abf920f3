"""Regenerate a conversation dataset with the target: every assistant turn becomes the target's own
response to the turns before it, so the drafter learns the distribution it will be asked to
predict at inference.

Conversations are read with `dflash.data.conversations` (prompt-only files are fine: a
conversation that ends with a user turn gets one response). A conversation with several assistant
turns is regenerated turn by turn, each turn seeing the target's earlier answers as history.

Output: JSONL in the `messages` form, one line per input conversation, in input order, with a
`meta` object saying how it was made (settings, input file and line). One run at a time writes an
output (a lock beside it). Writing is resumable: every batch is appended as whole lines and
synced; a rerun truncates a torn last line, skips the conversations already present (matched by
content: the turns that shape the response and the settings, not by line number) and, because
batches are always the same consecutive groups of valid input lines, regenerates an unfinished
batch exactly as an uninterrupted run would have. When the input file was edited, the lines of
conversations no longer in it are dropped and the changed ones regenerated; an output made of
another input file, or with other settings, is refused.

Modules: `config` (the options, checked first), `engines` (Hugging Face / vLLM / SGLang generation),
`output` (the lock, the lines written, resume), `run` (turn-by-turn generation and the run itself).
"""
from dflash.regenerate.config import BACKENDS, DTYPES, RegenerateConfig
from dflash.regenerate.engines import Generation, HFBackend, load_backend, load_tokenizer
from dflash.regenerate.run import regenerate, strip_thinking, summary

__all__ = ["BACKENDS", "DTYPES", "RegenerateConfig", "Generation", "HFBackend", "load_backend", "load_tokenizer",
           "regenerate", "strip_thinking", "summary"]
