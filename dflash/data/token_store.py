"""The token store: tokenized samples on disk, read by random access from memory-mapped files.

A store is a Hugging Face `datasets` folder (`Dataset.save_to_disk`: Arrow files) with columns
`input_ids` (int32 lists), `loss_mask` (uint8 lists, 1 on assistant tokens), `length`,
`supervised` (assistant tokens) and `source_line`, plus `dflash_store.json` (how it was made
and its summary). That file also marks the folder as dflash's own: only such a folder is ever
replaced, and it holds the fingerprints of what the store was derived from (the input file, the
tokenizer, the settings), so that a store of other data is rebuilt or refused, never used.
Arrow was chosen over a format of our own or DeepSpeed's indexed dataset because it holds
both token streams and the metadata in one standard, inspectable folder that `datasets` can
also read, writes in bounded memory, and its list columns are a flat value buffer plus
offsets: reading sample i is two slices of memory-mapped arrays, with no per-sample decoding
and no RAM proportional to the data set.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from dflash.errors import UserError

STORE_META = "dflash_store.json"
STORE_VERSION = 3  # 2: the supervised column; 3: fingerprints of the input and the tokenizer
COLUMNS = ("input_ids", "loss_mask", "length", "supervised", "source_line")
PREPARE_AGAIN = "prepare it again with launch/prepare_data.py (or delete it: the trainer rebuilds its own)"


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides token ids: vocabulary, merges, normalisation, special tokens and
    the chat template (padding and truncation settings left out: they change no id)."""
    from dflash.data.vocab import MASK_TOKEN

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("padding", None)
        spec.pop("truncation", None)
        # the trainer adds the DFlash mask token to the target's tokenizer; it tokenizes no data
        spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t.get("content") != MASK_TOKEN]
    else:
        spec = {"vocab": sorted((k, v) for k, v in tokenizer.get_vocab().items() if k != MASK_TOKEN)}
    spec["chat_template"] = tokenizer.chat_template
    text = json.dumps(spec, sort_keys=True, ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def read_store_meta(path: Path) -> dict | None:
    """The store's meta, or None when `path` is not a dflash store; a damaged meta is an error."""
    meta_path = Path(path) / STORE_META
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{meta_path}: damaged store description ({e}); {PREPARE_AGAIN}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("summary"), dict):
        raise UserError(f"{meta_path}: damaged store description (no summary); {PREPARE_AGAIN}")
    return meta


class _Column:
    """Zero-copy views of a chunked Arrow list column: values and offsets per chunk."""

    def __init__(self, chunked):
        self.values, self.offsets = [], []
        for chunk in chunked.chunks:
            self.values.append(chunk.values.to_numpy(zero_copy_only=True))
            self.offsets.append(chunk.offsets.to_numpy(zero_copy_only=True))
        sizes = [len(o) - 1 for o in self.offsets]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def get(self, i: int) -> np.ndarray:
        c = int(np.searchsorted(self.starts, i, side="right")) - 1
        off = self.offsets[c]
        j = i - self.starts[c]
        return self.values[c][off[j] : off[j + 1]]


class TokenStore:
    """Random access to a prepared data set.

    >>> store = TokenStore("data/demo")          # doctest: +SKIP
    >>> ids, mask = store[0]                     # int32 tokens, bool assistant mask
    >>> store.lengths[:4]                        # all lengths, without reading tokens
    """

    def __init__(self, path: str | Path):
        import datasets

        self.path = Path(path)
        meta = read_store_meta(self.path)
        if meta is None:
            raise UserError(
                f"{self.path}: not a dflash token store (no {STORE_META}); build one with "
                "`python launch/prepare_data.py --input FILE.jsonl --tokenizer PATH --output DIR`"
            )
        self.meta = meta
        if meta.get("version") != STORE_VERSION:
            raise UserError(f"{self.path / STORE_META}: store version {meta.get('version')} is not {STORE_VERSION}; "
                            f"{PREPARE_AGAIN}")
        try:
            self.dataset = datasets.load_from_disk(str(self.path))  # memory-mapped Arrow
            table = self.dataset.data.table
            missing = [c for c in COLUMNS if c not in table.column_names]
            if missing:
                raise ValueError(f"no column {', '.join(missing)}")
            self._ids = _Column(table.column("input_ids"))
            self._mask = _Column(table.column("loss_mask"))
            self.lengths = table.column("length").to_numpy().astype(np.int64)
            self.supervised = table.column("supervised").to_numpy().astype(np.int64)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - pyarrow, datasets and OS errors all mean: damaged files
            raise UserError(f"{self.path}: damaged token store ({type(e).__name__}: {e}); {PREPARE_AGAIN}") from None
        recorded = meta["summary"].get("samples")
        if recorded != len(self.lengths) or self._ids.starts[-1] != len(self.lengths):
            raise UserError(f"{self.path}: damaged token store ({len(self.lengths)} samples readable, "
                            f"{recorded} written); {PREPARE_AGAIN}")

    def __len__(self) -> int:
        return int(self.lengths.size)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} outside the store's {len(self)} samples")
        return self._ids.get(i), self._mask.get(i).view(np.bool_)

    def check_tokenizer(self, tokenizer, flag: str) -> None:
        """Refuse a store made with another tokenizer than `tokenizer` (that of `flag`)."""
        made, now = self.meta.get("tokenizer_fingerprint"), tokenizer_fingerprint(tokenizer)
        if made != now:
            raise UserError(f"{flag}: its tokenizer differs from the one {self.path} was made with "
                            f"({self.meta.get('tokenizer')}); prepare the data with the target's tokenizer")

    def candidates(self) -> np.ndarray:
        """Anchor candidates of every sample (`dflash.data.supervision`), counted from the loss masks."""
        from dflash.data.supervision import ragged_candidates

        return ragged_candidates(self.dataset.data.table.column("loss_mask"))

    @property
    def vocab_size(self) -> int | None:
        return self.meta.get("vocab_size")

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())
