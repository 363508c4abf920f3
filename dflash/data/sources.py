"""Conversation data as users have it: which format a path holds, and its conversations row by row.

Accepted: a JSONL file (read line by line by `dflash.data.conversations`, so that a bad line is
named with its number), a JSON file (an array of objects, decoded object by object with the
standard `json` module, so that each value is what the file says), a parquet file, an Arrow file
(IPC file or stream, e.g. a `datasets` cache file), a folder of parquet shards (the Hub's layout)
and a `Dataset.save_to_disk` folder. The format is found from the content (magic bytes, a
folder's `state.json`), never from the name alone. Tabular formats are read with pyarrow as
written, streamed (memory does not grow with the data), and their rows named `FILE: row N`
(0-based, per shard) as JSONL lines are `FILE:LINE`. No reader converts a value: `datasets`' JSON
builder turns a column of mixed types into JSON text, so it reads nothing here.

A folder is read whole or refused: data files of several formats are refused naming one of each,
and shards of several splits (the Hub's file names, resolved by `datasets.data_files`) need
`split` (`--split`), as a `DatasetDict` of several splits does.

Columns: `messages` ([{role, content}]), ShareGPT `conversations` ([{from, value}], human/gpt
mapped to user/assistant), or the column `messages_field` names (turns in either form; it decides
when the table has several). The column's type is checked before any row is read (a list of
turns, or JSON text of one); every row is normalised with `parse_conversation`, the same as a
JSONL line, so every format's store is the JSONL path's.
"""
from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash.data.conversations import BadSample, SkipCounter, parse_conversation, read_conversations
from dflash.data.tables import (
    arrow_part,
    check_turns_type,
    choose_split,
    json_array_rows,
    open_arrow,
    parquet_part,
    saved_part,
    saved_table,
)
from dflash.data.token_store import STORE_META
from dflash.errors import UserError
from dflash.identity import file_identity, same_file

FORMATS = ("JSONL, JSON (an array of objects), parquet, Arrow (IPC file or stream), a folder of parquet shards, "
           "a datasets save_to_disk folder")
LAYOUTS = ("'messages' [{role, content}], ShareGPT 'conversations' [{from, value}], or --messages-field COLUMN")
ARROW_STREAM = b"\xff\xff\xff\xff"  # an IPC stream's first message starts with the continuation marker
SAVED_MARKERS = ("state.json", "dataset_info.json")  # what Dataset.save_to_disk writes besides its Arrow files
# `datasets`' own description files, found beside a Hub folder's shards: no conversations
METADATA = frozenset({*SAVED_MARKERS, "dataset_infos.json", "dataset_dict.json"})


def is_token_store(path: Path) -> bool:
    """A folder prepare wrote (its meta file): read as a store, never as conversations."""
    return (Path(path) / STORE_META).is_file()


def _sniff(path: Path) -> str | None:
    """The data format of a file's content, or None."""
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
    return None


def _sniff_file(path: Path) -> str:
    kind = _sniff(path)
    if kind is None:
        with path.open("rb") as f:
            head = f.read(8)
        raise UserError(f"{path}: not a data format dflash reads (it starts with {head!r}); accepted: {FORMATS}")
    return kind


DATA_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json")  # names of data files: empty, one is refused


def _data_files(folder: Path) -> dict[str, list[Path]]:
    """The files of a folder by the format their content has (hidden ones and files of no data
    format, a README, left out), each list in path order."""
    found: dict[str, list[Path]] = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name not in METADATA and not any(part.startswith(".") for part in
                                                              p.relative_to(folder).parts):
            if not p.stat().st_size and p.suffix in DATA_SUFFIXES:  # a shard cut short, or never downloaded
                raise UserError(f"{p}: an empty {p.suffix[1:]} file (0 bytes) in the data folder {folder}; "
                                "download or copy it again, or remove it")
            kind = _sniff(p) if p.stat().st_size else None
            if kind is not None:
                found.setdefault(kind, []).append(p)
    return found


def _one_split(folder: Path, shards: list[Path], split: str | None, flag: str) -> list[Path]:
    """The shards of `split` where the Hub's file names give several splits (`datasets`' own rules:
    `data/train-*`, `test/...`); all of them where they name one."""
    from datasets.data_files import get_data_patterns, resolve_pattern

    try:
        patterns = get_data_patterns(str(folder))
    except Exception:  # noqa: BLE001 - no split layout datasets knows: one split, the whole folder
        patterns = {}
    def matches(pattern: str) -> list[str]:  # datasets' patterns are alternatives: one may match nothing
        try:
            return resolve_pattern(pattern, str(folder))
        except FileNotFoundError:
            return []

    splits = {str(name): sorted({Path(f) for pat in pats for f in matches(pat)} & set(shards))
              for name, pats in patterns.items()}
    splits = {name: files for name, files in splits.items() if files}
    if split is None:
        if len(splits) > 1:
            raise UserError(f"{flag} {folder}: holds the splits {', '.join(splits)} "
                            f"({', '.join(f'{n}: {len(f)} file(s)' for n, f in splits.items())}); "
                            + choose_split(folder, next(iter(splits)), flag))
        return shards
    if split not in splits:
        raise UserError(f"--split {split}: {folder} holds the splits {', '.join(splits) or 'none by name'}")
    return splits[split]


def detect(path: str | Path, flag: str = "--input", split: str | None = None) -> tuple[str, list[Path]]:
    """`(format, data files)` of `path`; an unknown format, a missing path, a folder of several
    formats or of several splits without `split` is one line."""
    path = Path(path)
    if path.is_file():
        if split is not None:
            raise UserError(f"--split {split}: {path} is one file, of one split; --split chooses among a "
                            "folder's splits")
        return _sniff_file(path), [path]
    if not path.is_dir():
        raise UserError(f"{flag} {path}: no such file or folder")
    if is_token_store(path):
        raise UserError(f"{flag} {path}: is a dflash token store (prepared data), not conversations")
    if all((path / m).is_file() for m in SAVED_MARKERS) or (path / "dataset_dict.json").is_file():
        return "saved", sorted(p for p in path.rglob("*") if p.is_file())
    found = _data_files(path)
    if len(found) > 1:
        raise UserError(f"{flag} {path}: holds data files of several formats ("
                        + ", ".join(f"{kind}: {files[0].relative_to(path)}" + (f" and {len(files) - 1} more"
                                                                               if len(files) > 1 else "")
                                    for kind, files in found.items())
                        + "); dflash reads a folder whole: give one file, or a folder of parquet shards only")
    if "parquet" in found:
        return "parquet", _one_split(path, found["parquet"], split, flag)
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
    split: str | None = None  # the split of a DatasetDict (a folder of shards keeps only its split's files)
    flag: str = "--input"  # names the path in errors

    @property
    def unit(self) -> str:
        """What an index counts: JSONL lines (1-based), else rows (0-based)."""
        return "line" if self.kind == "jsonl" else "row"

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    # -- reading -----------------------------------------------------------------------------
    def _parts(self) -> Iterator[tuple[Path, object, Iterator[dict]]]:
        """(file named in errors, its Arrow schema or None for JSON, its rows) per part, in order, streamed."""
        for part in ([self.path] if self.kind == "saved" else self.files):
            try:
                if self.kind == "json":
                    yield part, None, json_array_rows(part)
                    continue
                if self.kind == "saved":
                    schema, rows = saved_part(part, self.split, self.flag)
                else:
                    schema, rows = (parquet_part if self.kind == "parquet" else arrow_part)(part)
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - pyarrow and datasets errors: the file is not what it claims
                raise UserError(f"{part}: cannot read it as {self.kind} ({type(e).__name__}: {e}); "
                                f"accepted: {FORMATS}") from None
            yield part, schema, rows

    def _field_of(self, where: Path, schema, rows) -> tuple[str, Iterator[dict]]:
        """The conversation column of a part (its type checked) and the part's rows."""
        if schema is None:  # a JSON array: the columns are the first object's keys
            first = next(rows, None)
            columns = list(first) if isinstance(first, dict) else []
            rows = itertools.chain([] if first is None else [first], rows)
        else:
            columns = list(schema.names)
        if self.messages_field is not None:
            if self.messages_field not in columns:
                raise UserError(f"{where}: no column {self.messages_field!r} (--messages-field); "
                                f"{_columns_line(where, columns)}")
            name = self.messages_field
        else:
            name = next((n for n in ("messages", "conversations") if n in columns), None)
            if name is None:
                raise UserError(f"{where}: no 'messages' or 'conversations' column "
                                f"({_columns_line(where, columns)}); accepted layouts: {LAYOUTS}")
        if schema is not None:
            check_turns_type(where, name, schema)
        return name, rows

    def check_columns(self) -> None:
        """The conversation column is there with a type of turns (before any heavy work), else one
        line with the columns found or the column's type."""
        if self.kind == "jsonl":
            return  # per line: a line without them is a BadSample naming it
        for where, schema, rows in self._parts():
            self._field_of(where, schema, rows)

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
        for part, schema, part_rows in self._parts():
            name, part_rows = self._field_of(part, schema, part_rows)
            for j, row in enumerate(_stream(part_rows, part)):
                where = f"{part}: row {j}"
                try:
                    raw = _as_conversation(row, name, where)
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
        if self.kind == "json":
            return None
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)
        total = 0
        for part in ([self.path] if self.kind == "saved" else self.files):
            try:  # the batches' headers are read, not their data (memory-mapped)
                if self.kind == "saved":
                    total += saved_table(part, self.split, self.flag).num_rows
                else:
                    total += sum(batch.num_rows for batch in open_arrow(part)[1])
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - a cut or damaged Arrow file
                raise UserError(f"{part}: cannot be read to the end ({type(e).__name__}: {e})") from None
        return total

    # -- content fingerprint -----------------------------------------------------------------
    def fingerprint(self, sha256: str | None = None) -> dict:
        """A file's `file_identity` (`dflash.identity`, the rule targets follow too); a folder's: its
        path and every data file's."""
        if self.path.is_file():
            return file_identity(self.path, sha256=sha256)
        return {"path": str(self.path.resolve()),
                "files": [{**file_identity(f), "path": str(f.relative_to(self.path))} for f in self.files]}

    def same_content(self, recorded: dict) -> bool:
        """Whether the data hold what `recorded` (a `fingerprint`) was taken of."""
        if self.path.is_file():
            return "files" not in recorded and same_file(recorded, self.path)
        files = recorded.get("files")
        if not isinstance(files, list) or [f.get("path") for f in files] != \
                [str(f.relative_to(self.path)) for f in self.files]:
            return False
        return all(same_file(r, f) for r, f in zip(files, self.files, strict=True))


def _stream(rows, part: Path) -> Iterator[dict]:
    try:
        yield from rows
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or damaged file, found while reading
        raise UserError(f"{part}: cannot be read to the end ({type(e).__name__}: {e})") from None


def _as_conversation(row: dict, name: str, where: str) -> dict:
    """The row with the turns of column `name` (it decides, also over a `messages` column beside
    it) under the key their form gives `parse_conversation`; JSON text of turns decoded as a JSONL
    line's."""
    if not isinstance(row, dict) or name not in row:
        return row  # a JSON element without the column: parse_conversation names what it lacks
    turns = row[name]
    if isinstance(turns, str):
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError as e:
            raise BadSample(where, "invalid JSON", f"column {name!r}: not JSON text of turns ({e.msg} at "
                            f"character {e.pos})") from None
    first = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else {}
    key = "conversations" if "from" in first and "role" not in first else "messages"
    return {key: turns, **{k: v for k, v in row.items() if k not in (name, "messages", "conversations")}}


def open_source(path: str | Path, *, messages_field: str | None = None, flag: str = "--input",
                split: str | None = None) -> Source:
    """The conversations at `path` (of `split`, where it holds several), format and columns checked
    (one line naming the file if wrong)."""
    path = Path(path)
    kind, files = detect(path, flag, split)
    if messages_field is not None and kind == "jsonl":
        raise UserError(f"--messages-field {messages_field}: applies to parquet, Arrow, JSON and datasets "
                        f"folders; {path} is JSONL, whose lines hold 'messages' or 'conversations'")
    source = Source(path, kind, files, messages_field, split=split if kind == "saved" else None, flag=flag)
    source.check_columns()
    return source


def default_num_proc(source: Source) -> int:
    """Tokenizing processes: one per 16 MiB of data up to the CPUs this process may use, so a small
    file (the demo) is tokenized in this process, with nothing to start."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, source.size_bytes() // (16 << 20)))
