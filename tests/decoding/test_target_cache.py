"""TargetCache: after forwards and rollbacks of rejected drafts, the target's outputs equal one forward
of the kept tokens, for every family (hybrid targets' recurrent states cannot be cropped)."""
import pytest
import torch

from dflash.decoding.target_cache import TargetCache
from dflash.demo.families import CONFIGS, tiny_target


@pytest.mark.parametrize("family", list(CONFIGS))
def test_rolled_back_cache_equals_a_fresh_forward(family):
    hf = tiny_target(family)
    ids = torch.randint(0, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = TargetCache(hf)
    cache.forward(ids[:20])  # prefill
    cache.forward(ids[20:30])
    cache.keep(23)  # 3 of 10 accepted
    cache.forward(ids[23:25])
    cache.keep(25)  # all accepted: nothing to undo
    cache.forward(ids[25:33])
    cache.keep(26)  # 1 of 8
    out = cache.forward(ids[26:35], hidden=True)
    assert cache.length == 35 and out.logits.shape[1] == 9
    with torch.no_grad():
        ref = hf(torch.tensor([ids[:35]]), output_hidden_states=True)
    torch.testing.assert_close(out.logits[0], ref.logits[0, 26:35], rtol=1e-4, atol=1e-5)
    for got, want in zip(out.hidden_states, ref.hidden_states, strict=True):
        torch.testing.assert_close(got[0], want[0, 26:35], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="cannot keep"):
        cache.keep(20)
