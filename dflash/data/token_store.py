"""The token store: tokenized samples on disk, read by random access from memory-mapped files.

A store is a Hugging Face `datasets` folder (`Dataset.save_to_disk`: Arrow files) with columns
`input_ids` (int32 lists), `loss_mask` (uint8 lists, 1 on assistant tokens), `length`,
`supervised` (assistant tokens) and `source_line`, plus `dflash_store.json` (how it was made
and its summary). Arrow was chosen over a format of our own or DeepSpeed's indexed dataset
because it holds both token streams and the metadata in one standard, inspectable folder that
`datasets` can also read, writes in bounded memory, and its list columns are a flat value
buffer plus offsets: reading sample i is two slices of memory-mapped arrays, with no
per-sample decoding and no RAM proportional to the data set.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash.errors import UserError

STORE_META = "dflash_store.json"
STORE_VERSION = 2  # 2: the supervised column


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
        meta_path = self.path / STORE_META
        if not meta_path.is_file():
            raise UserError(
                f"{self.path}: not a dflash token store (no {STORE_META}); build one with "
                "`python launch/prepare_data.py --input FILE.jsonl --tokenizer PATH --output DIR`"
            )
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("version") != STORE_VERSION:
            raise UserError(f"{meta_path}: store version {self.meta.get('version')} is not {STORE_VERSION}; re-run prepare_data")
        self.dataset = datasets.load_from_disk(str(self.path))  # memory-mapped Arrow
        table = self.dataset.data.table
        self._ids = _Column(table.column("input_ids"))
        self._mask = _Column(table.column("loss_mask"))
        self.lengths = table.column("length").to_numpy().astype(np.int64)
        self.supervised = table.column("supervised").to_numpy().astype(np.int64)

    def __len__(self) -> int:
        return int(self.lengths.size)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} outside the store's {len(self)} samples")
        return self._ids.get(i), self._mask.get(i).view(np.bool_)

    @property
    def vocab_size(self) -> int | None:
        return self.meta.get("vocab_size")

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())
