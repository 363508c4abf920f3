"""Speculative decoding on every target family is lossless: hybrid targets (recurrent state rolled
back), MoE, sliding window + sinks (a window shorter than the prompt), MLA. The drafter here drafts
the target's own next tokens for the first k slots of a block, k = 0 .. B-1 in turn, then a wrong
one, so every acceptance length and every rollback happens."""
import itertools

import pytest
import torch

from dflash.decoding.speculate import greedy_decode, speculative_decode
from dflash.demo.families import CONFIGS, VOCAB, WINDOW, tiny_target
from dflash.models import DFlashDrafter, DrafterConfig, TargetModel

B = 8


def _scripted_drafter(hf, reference: list[int], prompt_len: int):
    target = TargetModel(hf, [0, 1])
    config = DrafterConfig.from_target(hf.config, mask_token_id=VOCAB - 1, block_size=B, draft_layers=1,
                                       target_layer_ids=[0, 1], vocab_size=VOCAB)
    drafter = DFlashDrafter(config, target.shared_weights(), attention_backend="torch")
    draft, turns = drafter.draft, itertools.count()

    def scripted(cache, features, anchor_token):
        logits = draft(cache, features, anchor_token)  # the real forward keeps the drafter cache going
        done = cache.length - prompt_len + 1  # tokens generated so far; the block drafts the next ones
        right = next(turns) % B
        want = reference[done:done + B - 1] + [0] * B
        script = [want[i] if i < right else (want[i] + 1) % VOCAB for i in range(B - 1)]
        return torch.nn.functional.one_hot(torch.tensor(script), logits.shape[-1]).to(logits.dtype)

    drafter.draft = scripted
    return drafter


@pytest.mark.parametrize("family", list(CONFIGS))
def test_speculative_decoding_is_lossless_for_every_family(family):
    hf = tiny_target(family)
    prompt = torch.randint(0, VOCAB, (3 * WINDOW,), generator=torch.Generator().manual_seed(2)).tolist()
    reference = greedy_decode(hf, prompt, max_new_tokens=48, stop_ids=[])
    assert len(reference.tokens) == 48
    spec = speculative_decode(hf, _scripted_drafter(hf, reference.tokens, len(prompt)), prompt,
                              max_new_tokens=48, stop_ids=[])
    assert spec.tokens == reference.tokens
    # k right drafts give k + 1 tokens per verify forward: (0+1 + ... + 7+1) = 36 tokens per 8 forwards
    assert spec.forwards < 15
    with torch.no_grad():  # the reference itself: greedy with a cache equals argmax of full forwards
        full = hf(torch.tensor([prompt + reference.tokens])).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
    assert full == reference.tokens
