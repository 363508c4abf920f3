"""Randomly initialised targets, to benchmark training before downloading any weights:
`--target random:qwen3-8b` (a named preset of `dflash.target.spec.PRESETS`) or
`--target random:PATH` (the shape of the model whose config.json is at PATH, e.g. a folder with
only that file).

The model is built from transformers' own code with random weights directly on the device in
the run's dtype (an 8B target in bf16 takes 16 GB and a second or two on a GPU), and comes with a
synthetic tokenizer sized to its embedding (`dflash.data.synthetic.synthetic_tokenizer`). It has
no text: train it on `--data random[:SAMPLES]`. Speed is that of the real model of the same
shape; loss and acceptance mean nothing.
"""
from __future__ import annotations

import torch

from dflash.target.spec import TargetSpec


def random_target(spec: TargetSpec, device, dtype, *, seed: int = 0):
    """(synthetic tokenizer, Hugging Face causal LM with random weights on `device` in `dtype`)."""
    from transformers import AutoModelForCausalLM

    from dflash.data.synthetic import synthetic_tokenizer

    torch.manual_seed(seed)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(spec.config, dtype=dtype)
    tokenizer = synthetic_tokenizer(hf.get_input_embeddings().weight.shape[0])
    return tokenizer, hf
