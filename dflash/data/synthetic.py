"""Synthetic data for benchmarks before anything is downloaded: `--data random[:SAMPLES]`.

A `SyntheticStore` reads like a `TokenStore` but lives in memory and holds no text: sample
lengths are seed-like (`seed_like_lengths`, cut at the run's maximum length), the supervised share
of each sample is drawn from Beta(4, 2) as for the seed-like supervised counts (a prompt, then one
assistant turn to its end), and the token ids are uniform over the tokenizer's ordinary tokens
(its special tokens never occur, so no turn ends early). Sample i is a function of (seed, i)
alone, so every rank and loader worker rebuilds the same data without talking and without files.

`synthetic_tokenizer(rows)` is the tokenizer of a randomly initialised target (`--target
random:...`): ordinary tokens `<t0>`, `<t1>`, ... filling the embedding table but for spare rows
(the DFlash mask token takes one), then `<|endoftext|>` (padding) and `<|im_end|>` (end of turn).
"""
from __future__ import annotations

import numpy as np

from dflash.errors import UserError

PREFIX = "random"
DEFAULT_SAMPLES = 10_000  # about 21.6M tokens: one epoch is a long benchmark, a subset a short one
SPARE_ROWS = 256  # embedding rows left free of tokens, as Qwen3 pads its table (151,936 rows, 151,669 tokens)


def is_synthetic(data: str) -> bool:
    return str(data) == PREFIX or str(data).startswith(PREFIX + ":")


def parse_samples(data: str, flag: str = "--data") -> int:
    """The number of samples of `random[:SAMPLES]` (default DEFAULT_SAMPLES)."""
    text = str(data)[len(PREFIX) + 1:]
    if not text:
        return DEFAULT_SAMPLES
    try:
        samples = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        samples = 0
    if samples < 1:
        raise UserError(f"{flag} {data}: expected random or random:SAMPLES with SAMPLES a positive integer, "
                        "e.g. random:2000")
    return samples


class SyntheticStore:
    """Seed-like synthetic samples in the TokenStore interface (`lengths`, `supervised`, `store[i]`
    -> (int32 ids, bool assistant mask), `meta`, `vocab_size`, `check_tokenizer`), with
    `candidates()` as the token store has it (each sample holds one supervised span).

    Args:
        num_samples: samples in the store.
        token_ids: the ids a sample is drawn from (the tokenizer's ordinary tokens).
        seed: the data's seed; lengths, masks and ids follow from it.
        max_length: samples are cut to this many tokens (the run's --max-length).
    """

    def __init__(self, num_samples: int, token_ids, *, seed: int = 0, max_length: int = 8192):
        from dflash.data.seed_lengths import seed_like_lengths

        self.num_samples, self.seed, self.max_length = int(num_samples), int(seed), int(max_length)
        self.token_ids = np.asarray(token_ids, dtype=np.int32)
        if self.token_ids.size == 0:
            raise UserError("synthetic data: the tokenizer has no ordinary token to draw ids from")
        self.lengths = np.minimum(seed_like_lengths(self.num_samples, seed=self.seed), self.max_length).astype(np.int64)
        share = np.random.default_rng([self.seed, 1]).beta(4.0, 2.0, self.num_samples)
        self.supervised = np.clip((self.lengths * share).astype(np.int64), 1, self.lengths)
        self.path = f"{PREFIX}:{self.num_samples}"
        self.meta = {"summary": {"input": self.path, "samples": self.num_samples, "tokens": int(self.lengths.sum())},
                     "synthetic": {"seed": self.seed, "max_length": self.max_length}}

    def __len__(self) -> int:
        return self.num_samples

    def __str__(self) -> str:
        return self.path

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        i = int(i)
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} outside the store's {self.num_samples} samples")
        n = int(self.lengths[i])
        rng = np.random.default_rng([self.seed, 2, i])
        ids = self.token_ids[rng.integers(0, self.token_ids.size, n)]
        mask = np.zeros(n, dtype=bool)
        mask[n - int(self.supervised[i]):] = True
        return ids, mask

    def candidates(self) -> np.ndarray:
        """Anchor candidates of every sample (`dflash.data.supervision`): one supervised span each."""
        from dflash.data.supervision import candidates_from_supervised

        return candidates_from_supervised(self.supervised)

    def check_tokenizer(self, tokenizer, flag: str) -> None:
        """Any tokenizer whose vocabulary holds the drawn ids will do (the ids mean nothing)."""
        if int(self.token_ids.max()) >= len(tokenizer):
            raise UserError(f"{flag}: its tokenizer has {len(tokenizer)} tokens, fewer than the synthetic data's ids")

    @property
    def vocab_size(self) -> int:
        return int(self.token_ids.max()) + 1

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())


def ordinary_token_ids(tokenizer) -> np.ndarray:
    """The ids of the tokenizer's base vocabulary that are not special tokens."""
    ids = np.arange(tokenizer.vocab_size, dtype=np.int32)
    return np.setdiff1d(ids, np.asarray(tokenizer.all_special_ids, dtype=np.int32))


def synthetic_store(data: str, tokenizer, *, seed: int, max_length: int) -> SyntheticStore:
    """The store of `--data random[:SAMPLES]` for a run with this tokenizer, seed and maximum length."""
    return SyntheticStore(parse_samples(data), ordinary_token_ids(tokenizer), seed=seed, max_length=max_length)


def open_store(source):
    """A token store folder (TokenStore), or a SyntheticStore as it is."""
    if isinstance(source, SyntheticStore):
        return source
    from dflash.data.token_store import TokenStore

    return TokenStore(source)


def synthetic_tokenizer(embedding_rows: int):
    """A fast tokenizer with ordinary tokens `<t0>`... for all but the spare rows of an embedding
    table of `embedding_rows`, then `<|endoftext|>` (pad) and `<|im_end|>` (eos); no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ordinary = embedding_rows - min(SPARE_ROWS, embedding_rows // 8) - 2
    if ordinary < 2:
        raise UserError(f"a synthetic tokenizer needs an embedding of at least 16 rows, got {embedding_rows}")
    backend = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(ordinary)}, unk_token="<t0>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   name_or_path=f"synthetic ({ordinary} tokens)")
