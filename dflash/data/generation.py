"""How the data's assistant turns were generated, as decoding must reproduce it: the tokens that
end a turn and the per-turn token limit a regenerated file records."""
from __future__ import annotations

import json
from pathlib import Path


def stop_ids(tokenizer, model_eos) -> list[int]:
    """End-of-turn tokens: the tokenizer's eos plus the generation config's (e.g. Qwen3 lists both
    `<|im_end|>` and `<|endoftext|>`)."""
    ids = [] if model_eos is None else ([model_eos] if isinstance(model_eos, int) else list(model_eos))
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def generation_eos(target: str):
    """The eos id(s) of the model's generation config (or its config), without loading weights;
    None for a target that is no folder (`random:...`: its tokenizer's eos ends turns)."""
    from transformers import GenerationConfig

    if not Path(target).is_dir():
        return None
    try:
        return GenerationConfig.from_pretrained(target).eos_token_id
    except OSError:
        return json.loads((Path(target) / "config.json").read_text()).get("eos_token_id")


def regeneration_limit(path: str | Path) -> int | None:
    """The `meta.max_new_tokens` every line of a regenerated JSONL file shares (None: a file not
    written by `regenerate`, or lines made with different limits). Decoding its prompts with that
    limit reproduces its turns, which stop there."""
    limits = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    limits.add(json.loads(line).get("meta", {}).get("max_new_tokens"))
                except (json.JSONDecodeError, AttributeError):
                    return None
    return limits.pop() if len(limits) == 1 and None not in limits else None
