"""Randomly initialised targets, to benchmark training before downloading any weights:
`--target random:qwen3-8b` (a named preset of `dflash.models.flops.PRESETS`) or
`--target random:PATH` (the shape of the model whose config.json is at PATH, e.g. a folder with
only that file).

The model is built from transformers' own code with random weights directly on the device in
the run's dtype (an 8B target in bf16 takes 16 GB and a second or two on a GPU), and comes with a
synthetic tokenizer sized to its embedding (`dflash.data.synthetic.synthetic_tokenizer`). It has
no text: train it on `--data random[:SAMPLES]`. Speed is that of the real model of the same
shape; loss and acceptance mean nothing.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dflash.errors import UserError
from dflash.models.flops import PRESETS

PREFIX = "random:"
# The transformers model type of each preset (the presets hold sizes only).
PRESET_MODEL_TYPES = {"qwen3-8b": "qwen3"}


def is_random_target(target: str) -> bool:
    return str(target).startswith(PREFIX)


def random_target_config(target: str, flag: str = "--target"):
    """The Hugging Face config of `random:PRESET` or `random:PATH`; refused with the choices when
    neither a preset nor a readable config.json."""
    from transformers import AutoConfig

    name = str(target)[len(PREFIX):]
    if name in PRESETS:
        return AutoConfig.for_model(PRESET_MODEL_TYPES[name], **PRESETS[name])
    path = Path(name)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not (path / "config.json").is_file():
        raise UserError(f"{flag} {target}: expected random:PRESET ({', '.join(PRESETS)}) or random:PATH with a "
                        f"config.json at PATH")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{flag} {target}: cannot read {path / 'config.json'} as a transformers config ({e})") from None
    return getattr(config, "text_config", None) or config


def random_target(target: str, device, dtype, *, seed: int = 0):
    """(synthetic tokenizer, Hugging Face causal LM with random weights on `device` in `dtype`)."""
    from transformers import AutoModelForCausalLM

    from dflash.data.synthetic import synthetic_tokenizer

    config = random_target_config(target)
    torch.manual_seed(seed)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tokenizer = synthetic_tokenizer(hf.get_input_embeddings().weight.shape[0])
    return tokenizer, hf
