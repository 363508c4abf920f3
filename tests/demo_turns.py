"""The demo target and its greedy turns, shared by the decoding tests (tests/decoding/test_speculate.py)
and the evaluator tests (tests/training/test_evaluator.py) through the session fixture `demo`
(tests/conftest.py), and the fitting of a drafter to those turns."""
from __future__ import annotations

import json

import numpy as np
import torch

from dflash.data.collate import collate_packed
from dflash.decoding.acceptance import every_anchor
from dflash.decoding.speculate import greedy_decode
from dflash.models import BlockLoss, TargetModel, default_gamma, ensure_mask_token, slot_weights
from dflash.objective.blocks import block_scorer

LIMIT = 32  # tokens per regenerated turn


def demo_turns() -> dict:
    """The demo target (fp32), its tokenizer, stop ids and the 8 turns of 5 demo conversations, regenerated
    by its greedy decoding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.data.generation import stop_ids
    from dflash.demo import DATA, TARGET
    from dflash.target.spec import load_target_spec

    tok = AutoTokenizer.from_pretrained(str(TARGET))
    hf = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32)
    target = TargetModel(hf, num_features=3)
    mask_id = ensure_mask_token(tok, target.num_embedding_rows)
    stops = stop_ids(tok, load_target_spec(str(TARGET)).generation_eos())
    with open(DATA) as f:
        conversations = [json.loads(next(f)) for _ in range(5)]
    prompts = []
    for c in conversations:
        msgs = c["messages"]
        for i in (i for i, m in enumerate(msgs) if m["role"] == "assistant"):
            text = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
            prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    newline = tok("\n", add_special_tokens=False)["input_ids"]

    def sample(prompt, out):
        # as the chat template renders a finished turn: `<|im_end|>\n`, the newline supervised too
        tail = newline if out[-1] in stops else []
        return np.asarray(prompt + out + tail), np.asarray([0] * len(prompt) + [1] * len(out + tail), dtype=bool)

    outs = [greedy_decode(hf, p, max_new_tokens=LIMIT, stop_ids=stops).tokens for p in prompts]
    assert any(out[-1] in stops for out in outs) and any(len(out) == LIMIT for out in outs)
    return dict(tok=tok, hf=hf, target=target, mask_id=mask_id, stops=stops, prompts=prompts, outs=outs,
                samples=[sample(p, out) for p, out in zip(prompts, outs, strict=True)], sample=sample)


def score(drafter, gamma=None, loss=None):
    """The drafter and its loss (default: the cross-entropy) on the blocks at given anchors, as the eval
    walk calls them."""
    B = drafter.block_size
    return block_scorer(drafter, loss or BlockLoss(), drafter.lm_head, mask_token_id=drafter.config.mask_token_id,
                        slot_weights=slot_weights(B, gamma or default_gamma(B)))


def fit(demo, drafter, steps=40, gamma=None, loss=None):
    """The drafter fitted to the regenerated turns (every anchor) by `loss` (default: the cross-entropy),
    so that blocks accept drafts."""
    batch = collate_packed(demo["samples"], range(len(demo["samples"])))
    feats = demo["target"].features(batch)
    (anchors,) = every_anchor(batch, drafter.block_size, max_blocks=10_000)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        out = score(drafter, gamma, loss)(batch, feats, anchors)
        opt.zero_grad()
        (out.loss_sum / out.weight_sum).backward()
        opt.step()
    return drafter.eval()
