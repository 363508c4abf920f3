"""Rows of the tabular formats as written: no reader converts a value.

A JSON array is decoded object by object with the standard `json` module (`datasets`' JSON builder
turns a column whose values have several types into JSON text, so a number among strings would
wrap every turn in quotes); parquet and Arrow files are read with pyarrow, batch by batch; a
`save_to_disk` folder through its Arrow table. Each part comes with its schema, so that the
conversation column's type is checked before a row is read (`check_turns_type`).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from dflash.errors import UserError

CHUNK = 1 << 20  # characters of a JSON array read at a time; an object larger than that grows it
BATCH = 256  # rows of a parquet or Arrow file decoded at a time
TURN_KEYS = (("role", "content"), ("from", "value"))


def json_array_rows(path: Path) -> Iterator[dict]:
    """The elements of the JSON array in `path`, one at a time, each decoded as the file says;
    memory holds one element (and a chunk). Broken JSON is one line naming the element."""
    decoder, size, index = json.JSONDecoder(), CHUNK, 0
    try:
        with path.open("r", encoding="utf-8") as f:
            buf, pos = f.read(size), 0

            def skip(pos):
                while pos < len(buf) and buf[pos] in " \t\r\n\ufeff":
                    pos += 1
                return pos
            pos, eof = skip(pos), not buf
            while pos >= len(buf) and not eof:  # blank space may fill a chunk
                buf = f.read(size)
                pos, eof = skip(0), not buf
            if buf[pos:pos + 1] != "[":
                raise UserError(f"{path}: not a JSON array")
            pos, expect_value = skip(pos + 1), True
            while True:
                if pos >= len(buf) - 1 and not eof:  # keep one character ahead: ']' or ',' decide
                    more = f.read(size)
                    eof = not more
                    buf, pos = buf[pos:] + more, 0
                    pos = skip(pos)
                    continue
                if buf[pos:pos + 1] == "]":
                    if skip(pos + 1) < len(buf) or f.read().strip():
                        raise UserError(f"{path}: text after the JSON array's end")
                    return
                if not expect_value:
                    if buf[pos:pos + 1] != ",":
                        raise UserError(f"{path}: row {index - 1}: invalid JSON (expected ',' or ']' after it)")
                    pos, expect_value = skip(pos + 1), True
                    continue
                try:
                    obj, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as e:
                    if eof:
                        raise UserError(f"{path}: row {index}: invalid JSON ({e.msg})") from None
                    more = f.read(size)  # the element runs past the chunk: read on, in larger chunks
                    size *= 2
                    eof = not more
                    buf, pos = buf[pos:] + more, 0
                    continue
                yield obj
                index += 1
                pos, expect_value = skip(end), False
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: row {index}: invalid UTF-8 ({e.reason})") from None


def _batches_rows(batches) -> Iterator[dict]:
    for batch in batches:
        yield from batch.to_pylist()


def parquet_part(path: Path):
    """`(schema, rows)` of a parquet file, read as written."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(str(path))
    return pf.schema_arrow, _batches_rows(pf.iter_batches(batch_size=BATCH))


def open_arrow(path: Path):
    """A reader of an Arrow IPC file or stream, memory-mapped (its batches are read when iterated)."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    head = source.read(6)
    source.seek(0)
    if head == b"ARROW1":
        reader = pa.ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    reader = pa.ipc.open_stream(source)
    return reader.schema, iter(reader)


def arrow_part(path: Path):
    schema, batches = open_arrow(path)
    return schema, _batches_rows(batches)


def saved_table(path: Path, split: str | None, flag: str = "--input"):
    """The Arrow table of a `save_to_disk` folder; a DatasetDict gives the split named, or its one split."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split is not None:
            if split not in ds:
                raise UserError(f"--split {split}: {path} holds the splits {', '.join(ds)}")
            ds = ds[split]
        elif len(ds) != 1:
            raise UserError(f"{path}: a DatasetDict with splits {', '.join(ds)}; "
                            + choose_split(path, next(iter(ds)), flag))
        else:
            ds = next(iter(ds.values()))
    elif split is not None:
        raise UserError(f"--split {split}: {path} is one Dataset, of one split; --split chooses among a "
                        "DatasetDict's splits")
    return ds.data.table


def saved_part(path: Path, split: str | None, flag: str = "--input"):
    """`(schema, rows)` of a `save_to_disk` folder (`saved_table`)."""
    table = saved_table(path, split, flag)
    return table.schema, _batches_rows(table.to_batches(max_chunksize=BATCH))


def choose_split(folder: Path, example: str, flag: str) -> str:
    """How to choose a split: `--split` where the command has it, else a store of one split."""
    if flag == "--input":
        return f"choose one with --split, e.g. --split {example}"
    return (f"prepare one split into a token store (prepare_data.py --input {folder} --split {example}) and pass "
            f"the store as {flag}")


def check_turns_type(where: Path, name: str, schema) -> None:
    """The column `name` holds turns (a list of structs with string role/content or from/value) or
    JSON text of them; anything else (numbers, a struct of other keys, nulls only) is one line
    naming the file, the column and its type, before any row is converted."""
    import pyarrow as pa

    kind = schema.field(name).type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return  # JSON text: each row decoded and checked as a JSONL line is
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_struct(kind.value_type):
        fields = {f.name: f.type for f in kind.value_type}
        for keys in TURN_KEYS:
            if all(k in fields for k in keys):
                if all(pa.types.is_string(fields[k]) or pa.types.is_large_string(fields[k]) for k in keys):
                    return
                break
    raise UserError(f"{where}: column {name!r} is {kind}; expected a list of turns with string 'role' and "
                    "'content' (or 'from' and 'value'), or JSON text of such a list")
