"""How the data's assistant turns were generated, as decoding must reproduce it: the tokens that
end a turn and the per-turn token limit a regenerated file records."""
from __future__ import annotations

import json
from pathlib import Path


def stop_ids(tokenizer, model_eos) -> list[int]:
    """End-of-turn tokens: the tokenizer's eos plus the generation config's (`TargetSpec.generation_eos`;
    e.g. Qwen3 lists both `<|im_end|>` and `<|endoftext|>`)."""
    ids = [] if model_eos is None else ([model_eos] if isinstance(model_eos, int) else list(model_eos))
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def _shared_meta(path: str | Path, key: str):
    """`meta[key]` when every line of a JSONL file has the same one, else None."""
    values = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    values.add(json.loads(line).get("meta", {}).get(key))
                except (json.JSONDecodeError, AttributeError):
                    return None
    return values.pop() if len(values) == 1 and None not in values else None


def regeneration_limit(path: str | Path) -> int | None:
    """The `meta.max_new_tokens` every line of a regenerated JSONL file shares (None: a file not
    written by `regenerate`, or lines made with different limits). Decoding its prompts with that
    limit reproduces its turns, which stop there."""
    return _shared_meta(path, "max_new_tokens")


def regeneration_temperature(path: str | Path) -> float | None:
    """The `meta.temperature` every line of a regenerated JSONL file shares (0: greedy), else None:
    the walk at a temperature T is exact in expectation on turns sampled at T."""
    return _shared_meta(path, "temperature")
