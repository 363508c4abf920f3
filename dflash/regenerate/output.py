"""The output file of a regeneration: one run at a time (a lock beside it), whole lines appended and
synced, and resume: the lines already there matched with the input's conversations by content,
a torn last line cut off, the lines of conversations no longer in the input dropped.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from dflash.data.conversations import parse_conversation
from dflash.data.sources import Source
from dflash.errors import UserError, os_reason
from dflash.partial import replace_file
from dflash.regenerate.config import SETTINGS, RegenerateConfig


def conversation_key(messages: list[dict], raw: dict) -> str:
    """What shapes a conversation's regeneration, hashed: its turns with the assistant turns' text
    left out (they are regenerated), a final user turn counted as followed by one, and the line's
    other fields (copied to the output). The same for an input line and the output line made of it."""
    turns = [[m["role"], None if m["role"] == "assistant" else m["content"]] for m in messages]
    if turns[-1][0] == "user":
        turns.append(["assistant", None])
    extra = {k: v for k, v in raw.items() if k not in ("messages", "conversations", "meta")}
    text = json.dumps([turns, extra], sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class OutputLine:
    source_line: int  # the input line it was made of
    key: str  # conversation_key
    data: bytes  # the line as written


def read_output(output: Path, settings: dict) -> list[OutputLine]:
    """The lines of an existing `--output`. A torn last line (a crash mid-write) is cut off; a line
    not written by regenerate, or made with other generation settings, is an error."""
    if not output.exists():
        return []
    data = output.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with output.open("r+b") as f:
            f.truncate(end)
    lines = []
    for lineno, line in enumerate(data[:end].splitlines(keepends=True), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            meta = row["meta"]
            source = int(meta["source_line"])
            messages = parse_conversation(row, f"{output}:{lineno}")
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{output}:{lineno}: not a line written by regenerate (no meta.source_line); "
                            "give a new --output") from None
        mismatch = [k for k in SETTINGS if meta.get(k) != settings[k]]
        if mismatch:
            diff = ", ".join(f"{k}={meta.get(k)!r} (now {settings[k]!r})" for k in mismatch)
            raise UserError(f"{output}:{lineno} was generated with other settings: {diff}; resume with the same "
                            "settings or give a new --output")
        lines.append(OutputLine(source, conversation_key(messages, row), line))
    return lines


def input_keys(source: Source) -> dict[int, str]:
    """conversation_key of every usable line (row) of the input, by line number (row index)."""
    return {index: conversation_key(messages, raw)
            for index, _, messages, raw in source.rows(skip_bad=True, require_assistant=False)}


def _with_source_line(line: OutputLine, source_line: int) -> bytes:
    if line.source_line == source_line:
        return line.data
    row = json.loads(line.data)
    row["meta"]["source_line"] = source_line
    return dump_line(row)


def resume_output(output: Path, cfg: RegenerateConfig, settings: dict, say,
                  source: Source) -> tuple[set[int], int]:
    """Match the lines already in `output` with the input's conversations by content: returns the
    input lines done and how many output lines were dropped.

    A line is kept for an input line whose conversation is the one it was made of (the same line
    first, else a moved one, which gets its new line number). When the output also holds lines of
    conversations no longer in the input, the input was edited: they are dropped (the file is
    rewritten, in input order) and the changed conversations regenerated, but only when the output
    was made of this input file; lines of another file are a foreign output, refused.
    """
    lines = read_output(output, settings)
    if not lines:
        return set(), 0
    keys = input_keys(source)
    by_key: dict[str, list[OutputLine]] = {}
    for line in lines:
        by_key.setdefault(line.key, []).append(line)
    kept: dict[int, bytes] = {}
    for lineno, key in keys.items():  # exact first: the same content at the same line
        same = [x for x in by_key.get(key, ()) if x.source_line == lineno]
        if same:
            kept[lineno] = same[0].data
            by_key[key].remove(same[0])
    for lineno, key in keys.items():  # then moved: the same content at another line
        if lineno not in kept and by_key.get(key):
            kept[lineno] = _with_source_line(by_key[key].pop(0), lineno)
    stale = sum(len(v) for v in by_key.values())
    source = str(Path(cfg.input).resolve())
    if stale:
        made_of = {json.loads(x.data)["meta"].get("source") for x in lines}
        if made_of != {source}:
            other = ", ".join(sorted(str(m) for m in made_of if m != source)) or "an unknown input"
            raise UserError(
                f"--output {output}: {stale} of its {len(lines)} conversations are not in --input {cfg.input} "
                f"(it was regenerated from {other}); give a new --output, or the input it was made of to resume it")
        say(f"--input {cfg.input} changed since {output} was written: {stale} conversation(s) no longer in it are "
            f"dropped, {len(keys) - len(kept)} new or changed ones are regenerated")
    if [x.data for x in lines] != [kept[k] for k in sorted(kept)]:  # stale, moved or out of order
        try:
            replace_file(output, (kept[k] for k in sorted(kept)))
        except OSError as err:
            raise UserError(f"--output {output}: cannot rewrite it ({os_reason(err, output)}); it is unchanged") \
                from None
    return set(kept), stale


def dump_line(row: dict) -> bytes:
    """One JSONL line, UTF-8; text that is not (a lone surrogate escape in a field of the input line
    that is copied) stays escaped."""
    try:
        return (json.dumps(row, ensure_ascii=False) + "\n").encode()
    except UnicodeEncodeError:
        return (json.dumps(row) + "\n").encode()


def sort_output(output: Path) -> None:
    """Rewrite `output` in input order (by meta.source_line), all or nothing; a crash before it
    leaves complete lines in another order, which a rerun sorts."""
    lines = output.read_bytes().splitlines(keepends=True)
    lines.sort(key=lambda line: json.loads(line)["meta"]["source_line"])
    try:
        replace_file(output, lines)
    except OSError as err:
        raise UserError(f"--output {output}: cannot rewrite it in input order ({os_reason(err, output)}); every "
                        "line is written: rerun the same command to sort it") from None


def write_all(fd: int, data: bytes) -> None:
    """os.write may write part of `data` (a disk filling up): write the rest, or raise."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
