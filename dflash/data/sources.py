"""Conversation data as users have it: which format a path holds, and its conversations row by row.

Accepted: a JSONL file (read line by line by `dflash.data.conversations`, so that a bad line is
named with its number), and through `datasets`: a JSON file (an array of objects), a parquet
file, an Arrow file (IPC file or stream, e.g. a `datasets` cache file), a folder of parquet shards
(the Hub's layout; all `*.parquet` under it, in path order) and a `Dataset.save_to_disk` folder.
The format is found from the content (magic bytes, a folder's `state.json`), never from the name
alone. Tabular formats are streamed (memory does not grow with the data) and their rows named
`FILE: row N` (0-based, per shard) as JSONL lines are `FILE:LINE`.

Columns: `messages` ([{role, content}]), ShareGPT `conversations` ([{from, value}], human/gpt
mapped to user/assistant), or the column `messages_field` names (turns in either form). Every row
is normalised with `parse_conversation`, the same as a JSONL line.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash.data.conversations import BadSample, SkipCounter, parse_conversation, read_conversations
from dflash.data.token_store import STORE_META, file_fingerprint, same_file_content
from dflash.errors import UserError

FORMATS = ("JSONL, JSON (an array of objects), parquet, Arrow (IPC file or stream), a folder of parquet shards, "
           "a datasets save_to_disk folder")
LAYOUTS = ("'messages' [{role, content}], ShareGPT 'conversations' [{from, value}], or --messages-field COLUMN")
ARROW_STREAM = b"\xff\xff\xff\xff"  # an IPC stream's first message starts with the continuation marker
SAVED_MARKERS = ("state.json", "dataset_info.json")  # what Dataset.save_to_disk writes besides its Arrow files


def is_token_store(path: Path) -> bool:
    """A folder prepare wrote (its meta file): read as a store, never as conversations."""
    return (Path(path) / STORE_META).is_file()


def _sniff_file(path: Path) -> str:
    with path.open("rb") as f:
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1") or head.startswith(ARROW_STREAM):
        return "arrow"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if not text or text.startswith(b"{"):
        return "jsonl"  # an empty file: JSONL's own "no usable sample" error
    if text.startswith(b"["):
        return "json"
    raise UserError(f"{path}: not a data format dflash reads (it starts with {head[:8]!r}); accepted: {FORMATS}")


def detect(path: str | Path, flag: str = "--input") -> tuple[str, list[Path]]:
    """`(format, data files)` of `path`; an unknown format or a missing path is one line."""
    path = Path(path)
    if path.is_file():
        return _sniff_file(path), [path]
    if not path.is_dir():
        raise UserError(f"{flag} {path}: no such file or folder")
    if is_token_store(path):
        raise UserError(f"{flag} {path}: is a dflash token store (prepared data), not conversations")
    if all((path / m).is_file() for m in SAVED_MARKERS) or (path / "dataset_dict.json").is_file():
        return "saved", sorted(p for p in path.rglob("*") if p.is_file())
    shards = sorted(p for p in path.rglob("*.parquet") if p.is_file())
    if shards:
        return "parquet", shards
    raise UserError(f"{flag} {path}: a folder with neither parquet files nor a datasets save_to_disk dataset "
                    f"({', '.join(SAVED_MARKERS)}); accepted: {FORMATS}")


def _columns_line(path: Path, columns) -> str:
    return f"columns: {', '.join(map(str, columns)) or 'none'}"


@dataclass
class Source:
    """Conversations at `path` in one of the accepted formats (see the module)."""

    path: Path
    kind: str  # jsonl | json | parquet | arrow | saved
    files: list[Path]
    messages_field: str | None = None
    rows_read: int | None = None  # rows of a tabular source, once `rows` has read them all

    @property
    def unit(self) -> str:
        """What an index counts: JSONL lines (1-based), else rows (0-based)."""
        return "line" if self.kind == "jsonl" else "row"

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    # -- reading -----------------------------------------------------------------------------
    def _tables(self) -> Iterator[tuple[Path, object]]:
        """(file named in errors, row iterable) per part, in order, streamed."""
        import datasets

        datasets.disable_progress_bars()
        try:
            if self.kind == "saved":
                ds = datasets.load_from_disk(str(self.path))
                if isinstance(ds, datasets.DatasetDict):
                    if len(ds) != 1:
                        raise UserError(f"{self.path}: a DatasetDict with splits {', '.join(ds)}; give one split's "
                                        f"folder, e.g. {self.path / next(iter(ds))}")
                    ds = next(iter(ds.values()))
                yield self.path, ds
                return
            builder = "json" if self.kind == "json" else self.kind
            for f in self.files:
                yield f, datasets.load_dataset(builder, data_files=[str(f)], split="train", streaming=True)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - pyarrow and datasets errors: the file is not what it claims
            raise UserError(f"{self.path}: cannot read it as {self.kind} ({type(e).__name__}: {e}); "
                            f"accepted: {FORMATS}") from None

    def _field_of(self, where: Path, columns: list[str]) -> str:
        if self.messages_field is not None:
            if self.messages_field not in columns:
                raise UserError(f"{where}: no column {self.messages_field!r} (--messages-field); "
                                f"{_columns_line(where, columns)}")
            return self.messages_field
        for name in ("messages", "conversations"):
            if name in columns:
                return name
        raise UserError(f"{where}: no 'messages' or 'conversations' column ({_columns_line(where, columns)}); "
                        f"accepted layouts: {LAYOUTS}")

    def check_columns(self) -> None:
        """The conversation column is there (before any heavy work), else one line with the columns found."""
        if self.kind == "jsonl":
            return  # per line: a line without them is a BadSample naming it
        for where, table in self._tables():
            self._field_of(where, _column_names(table))

    def rows(self, *, skip_bad: bool = False, skipped: SkipCounter | None = None,
             require_assistant: bool = True) -> Iterator[tuple[int, str, list[dict], dict]]:
        """`(index, where, messages, raw)` for every usable row: `index` is the line number (JSONL)
        or the row over all parts (0-based); `where` names it in errors; `raw` is the row with its
        conversation under `messages` (or `conversations`). Bad rows as `read_conversations`."""
        if self.kind == "jsonl":
            for lineno, messages, raw in read_conversations(self.path, skip_bad=skip_bad, skipped=skipped,
                                                            require_assistant=require_assistant):
                yield lineno, f"{self.path}:{lineno}", messages, raw
            return
        index = 0
        for part, table in self._tables():
            name = self._field_of(part, _column_names(table))
            for j, row in enumerate(_stream(table, part)):
                where = f"{part}: row {j}"
                raw = _as_conversation(row, name)
                try:
                    messages = parse_conversation(raw, where, require_assistant=require_assistant)
                except BadSample as err:
                    if not skip_bad:
                        raise
                    if skipped is not None:
                        skipped.add(err)
                    index += 1
                    continue
                yield index, where, messages, raw
                index += 1
        self.rows_read = index

    def count(self) -> int | None:
        """Lines (JSONL) or rows, where the files say it without being read; else None."""
        if self.kind == "jsonl":
            with self.path.open("rb") as f:
                return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b""))
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)
        if self.kind == "arrow":
            import pyarrow as pa

            def rows(f):  # memory-mapped: the batches' headers are read, not their data
                with pa.memory_map(str(f)) as m:
                    head = m.read(6)
                    m.seek(0)
                    reader = pa.ipc.open_file(m) if head == b"ARROW1" else pa.ipc.open_stream(m)
                    return reader.read_all().num_rows
            return sum(rows(f) for f in self.files)
        if self.kind == "saved":
            return sum(len(t) for _, t in self._tables())
        return None

    # -- content fingerprint -----------------------------------------------------------------
    def fingerprint(self, sha256: str | None = None) -> dict:
        """A file's `file_fingerprint`; a folder's: its path and every data file's."""
        if self.path.is_file():
            return file_fingerprint(self.path, sha256)
        return {"path": str(self.path.resolve()),
                "files": [{**file_fingerprint(f), "path": str(f.relative_to(self.path))} for f in self.files]}

    def same_content(self, recorded: dict) -> bool:
        """Whether the data hold what `recorded` (a `fingerprint`) was taken of."""
        if self.path.is_file():
            return "files" not in recorded and same_file_content(recorded, self.path)
        files = recorded.get("files")
        if not isinstance(files, list) or [f.get("path") for f in files] != \
                [str(f.relative_to(self.path)) for f in self.files]:
            return False
        return all(same_file_content(r, f) for r, f in zip(files, self.files, strict=True))


def _column_names(table) -> list[str]:
    names = table.column_names
    if names is None:  # a streamed JSON file: columns known once a row is read
        first = next(iter(table), None)
        names = list(first) if isinstance(first, dict) else []
    return list(names)


def _stream(table, part: Path) -> Iterator[dict]:
    try:
        yield from table
    except Exception as e:  # noqa: BLE001 - a truncated or damaged file, found while reading
        raise UserError(f"{part}: cannot be read to the end ({type(e).__name__}: {e})") from None


def _as_conversation(row: dict, name: str) -> dict:
    """The row with its conversation under the key `parse_conversation` expects."""
    turns = row[name]
    if name in ("messages", "conversations"):
        return row
    first = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else {}
    key = "conversations" if "from" in first and "role" not in first else "messages"
    return {key: turns, **{k: v for k, v in row.items() if k not in (name, "messages", "conversations")}}


def open_source(path: str | Path, *, messages_field: str | None = None, flag: str = "--input") -> Source:
    """The conversations at `path`, format and columns checked (one line naming the file if wrong)."""
    path = Path(path)
    kind, files = detect(path, flag)
    if messages_field is not None and kind == "jsonl":
        raise UserError(f"--messages-field {messages_field}: applies to parquet, Arrow, JSON and datasets "
                        f"folders; {path} is JSONL, whose lines hold 'messages' or 'conversations'")
    source = Source(path, kind, files, messages_field)
    source.check_columns()
    return source


def default_num_proc(source: Source) -> int:
    """Tokenizing processes: one per 16 MiB of data up to the CPUs this process may use, so a small
    file (the demo) is tokenized in this process, with nothing to start."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, source.size_bytes() // (16 << 20)))
