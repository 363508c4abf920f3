"""Synthetic data (`--data random[:N]`) and the synthetic tokenizer of random targets."""
import numpy as np
import pytest

from dflash.data.seed_lengths import seed_like_lengths
from dflash.data.supervision import candidates_from_supervised
from dflash.data.synthetic import (
    DEFAULT_SAMPLES,
    SyntheticStore,
    is_synthetic,
    open_store,
    parse_samples,
    synthetic_store,
    synthetic_tokenizer,
)
from dflash.data.vocab import ensure_mask_token
from dflash.errors import UserError


def test_specs_parse_and_bad_ones_are_refused_with_the_form():
    assert is_synthetic("random") and is_synthetic("random:20") and not is_synthetic("randomness.jsonl")
    assert parse_samples("random") == DEFAULT_SAMPLES and parse_samples("random:2,000") == 2000
    for bad in ("random:0", "random:-3", "random:lots"):
        with pytest.raises(UserError, match=r"random:SAMPLES"):
            parse_samples(bad)


def test_samples_are_seed_like_reproducible_and_need_no_files():
    tok = synthetic_tokenizer(512)
    store = synthetic_store("random:400", tok, seed=3, max_length=1024)
    assert open_store(store) is store and len(store) == 400 and str(store) == "random:400"
    assert np.array_equal(store.lengths, np.minimum(seed_like_lengths(400, seed=3), 1024))
    again = synthetic_store("random:400", tok, seed=3, max_length=1024)
    other = synthetic_store("random:400", tok, seed=4, max_length=1024)
    assert not np.array_equal(store.lengths, other.lengths)
    specials = set(tok.all_special_ids)
    for i in (0, 7, 399):
        ids, mask = store[i]
        ids2, mask2 = again[i]
        assert np.array_equal(ids, ids2) and np.array_equal(mask, mask2)  # a function of (seed, i)
        assert ids.dtype == np.int32 and mask.dtype == bool and ids.size == store.lengths[i]
        assert not specials & set(ids.tolist()) and ids.max() < tok.vocab_size  # no turn ends early
        # a prompt, then one assistant turn to the end
        n_sup = int(store.supervised[i])
        assert mask.sum() == n_sup and mask[ids.size - n_sup:].all()
    share = store.supervised / store.lengths
    assert 0.6 < share.mean() < 0.73  # Beta(4, 2): mean 2/3
    # one supervised span: the candidates the anchor sampler draws from
    assert np.array_equal(store.candidates(), candidates_from_supervised(store.supervised))
    with pytest.raises(IndexError):
        store[400]


def test_the_synthetic_tokenizer_leaves_spare_rows_for_the_mask_token():
    for rows in (512, 151936):
        tok = synthetic_tokenizer(rows)
        assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
        assert rows - len(tok) == min(256, rows // 8)
        assert ensure_mask_token(tok, rows) == len(tok) - 1 < rows


def test_a_store_checks_the_tokenizer_can_hold_its_ids():
    store = SyntheticStore(10, np.arange(300), max_length=64)
    store.check_tokenizer(synthetic_tokenizer(512), "--target t")
    with pytest.raises(UserError, match="--target t: its tokenizer has 98 tokens"):
        store.check_tokenizer(synthetic_tokenizer(112), "--target t")
