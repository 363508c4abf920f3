"""raw conversations (JSONL, JSON, parquet, Arrow, datasets folders) -> token store: each sample fitted
to the over-long policy, the store staged and renamed into place, and a run's store kept matching its
input, tokenizer and settings (`ensure_store`). Tokenizing (chat template, loss mask): `dflash.data.tokenizing`."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dflash.data.conversations import BadSample, SkipCounter
from dflash.data.sources import Source, default_num_proc, open_source
from dflash.data.token_store import (
    STORE_META,
    STORE_VERSION,
    read_store_meta,
    tokenizer_fingerprint,
)
from dflash.data.tokenizing import load_tokenizer, tokenized
from dflash.errors import UserError, disk_full, free_space, os_reason
from dflash.partial import OutputLock, check_apart, folder_entries, partial_folder

OVERLONG = ("truncate", "drop", "error")


def scan_file(path: Path) -> tuple[int, str]:
    """Lines in a file (a last line without a newline counts) and its SHA-256, in one read of
    16 MiB chunks."""
    count, last, h = 0, b"\n", hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            count += chunk.count(b"\n")
            last = chunk[-1:]
            h.update(chunk)
    return count + (last != b"\n"), h.hexdigest()


@dataclass
class PrepareSummary:
    input: str
    output: str
    unit: str = "line"  # what lines_read counts: JSONL lines, or rows of the other formats
    lines_read: int = 0
    samples: int = 0
    tokens: int = 0
    assistant_tokens: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_no_loss: int = 0
    skipped: dict = field(default_factory=dict)
    length_stats: dict = field(default_factory=dict)
    seconds: float = 0.0

    def text(self) -> str:
        lines = [
            f"wrote {self.samples:,} samples, {self.tokens:,} tokens ({self.assistant_tokens:,} supervised) "
            f"to {self.output} in {self.seconds:.1f}s",
            f"  {self.unit}s read: {self.lines_read:,}",
            f"  over-long: {self.truncated:,} truncated, {self.dropped_overlong:,} dropped",
            f"  dropped with no supervised token left: {self.dropped_no_loss:,}",
        ]
        if self.skipped:
            lines.append(f"  skipped bad {self.unit}s: {sum(self.skipped.values()):,} "
                         + ", ".join(f"{k}: {v}" for k, v in self.skipped.items()))
        if self.length_stats:
            s = self.length_stats
            lines.append(f"  lengths: min {s['min']}, mean {s['mean']:.0f}, p50 {s['p50']}, p99 {s['p99']}, "
                         f"max {s['max']}")
        return "\n".join(lines)


def settings_of(max_length: int | None, overlong: str, skip_bad: bool, messages_field: str | None = None,
                split: str | None = None) -> dict:
    """The preparation settings a store records, and is rebuilt or refused for when they change
    (`messages_field` and `split` only when given: the stores made before them are still those of JSONL)."""
    return {"max_length": max_length, "overlong": overlong, "skip_bad": skip_bad,
            **({"messages_field": messages_field} if messages_field is not None else {}),
            **({"split": split} if split is not None else {})}


def store_differences(store_dir: Path, source: Source | Path, tokenizer, settings: dict) -> list[str]:
    """How the store at `store_dir` differs from one made now of `source` (or the data at that
    path) with `tokenizer` and `settings`: empty when it can be used as is."""
    if not isinstance(source, Source):
        source = open_source(source, messages_field=settings.get("messages_field"), split=settings.get("split"))
    meta = read_store_meta(store_dir)
    if meta is None:
        return [f"{store_dir} is not a token store"]
    if meta.get("version") != STORE_VERSION:
        return [f"store version {meta.get('version')} is not {STORE_VERSION}"]
    diffs = input_differences(store_dir, source)
    if meta.get("tokenizer_fingerprint") != tokenizer_fingerprint(tokenizer):
        diffs.append(f"tokenizer: {meta.get('tokenizer')} -> {getattr(tokenizer, 'name_or_path', None)}")
    for key, value in {"messages_field": None, "split": None, **settings}.items():
        if meta.get("settings", {}).get(key) != value:
            diffs.append(f"{key}: {meta.get('settings', {}).get(key)} -> {value}")
    return diffs


def input_differences(store_dir: Path, source: Source) -> list[str]:
    """How the input the store at `store_dir` was made of differs from `source` now (its path or
    its content): needs no tokenizer, so a resume checks it before the target loads."""
    made, input_path = (read_store_meta(store_dir) or {}).get("input_fingerprint") or {}, source.path
    if made.get("path") != str(input_path.resolve()):
        return [f"input: {made.get('path')} -> {input_path.resolve()}"]
    if not source.same_content(made):
        return [f"input: {input_path} changed since the store was made"]
    return []


def refuse_changed_store(store_dir: Path, diffs: list[str]) -> None:
    """A resumed run's store of other data or settings is refused, never rebuilt (nothing replaced)."""
    if diffs:
        raise UserError(f"--resume: the run's token store {store_dir} was made of other data or settings:\n  "
                        + "\n  ".join(diffs) + "\nresume with the same --data, --target and --max-length, or "
                        "start a new run (--overwrite or another --output-dir)")


STORE_FILES = (STORE_META, "dataset_info.json", "state.json", "data-*.arrow")  # what a store holds


def _store_file(name: str) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(name, pattern) for pattern in STORE_FILES)


def check_replaceable(output_dir: Path, overwrite: bool, flag: str = "--output") -> None:
    """Refuse to write the store where it would delete anything dflash did not create: only an
    empty folder or a token store (marked by its meta file) holding nothing else is replaced (what
    the preparation reads is kept apart before: `prepare_jsonl`)."""
    if not output_dir.exists():
        return
    if not output_dir.is_dir():
        raise UserError(f"{flag} {output_dir}: exists and is not a folder; choose another path")
    if read_store_meta(output_dir) is None and any(output_dir.iterdir()):
        raise UserError(f"{flag} {output_dir}: exists and is not a dflash token store (no {STORE_META}); dflash "
                        "replaces only folders it made: choose another folder, or move its contents away")
    if not overwrite:
        raise UserError(f"{flag} {output_dir} already exists; choose another folder or pass --overwrite")
    _, others = folder_entries(output_dir, _store_file)
    if others:
        raise UserError(f"{flag} {output_dir}: --overwrite replaces only what dflash wrote, and the store also holds "
                        f"{', '.join(p.name for p in others)}: move those away (or choose another folder); nothing "
                        "was deleted")


def _check_arguments(max_length: int | None, overlong: str, num_proc: int | None) -> None:
    if overlong not in OVERLONG:
        raise UserError(f"--overlong must be one of {', '.join(OVERLONG)}; got {overlong!r}")
    if max_length is not None and max_length < 2:
        raise UserError(f"--max-length must be >= 2, got {max_length}")
    if num_proc is not None and num_proc < 1:
        raise UserError(f"--num-proc must be at least 1, got {num_proc}")


def _fit(ids, mask, where: str, *, vocab: int, max_length: int | None, overlong: str, summary: PrepareSummary):
    """A tokenized sample as the store keeps it: ids checked against the vocabulary, cut or dropped
    (None) as `overlong` says, dropped when no supervised token is left; counted in `summary`."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise UserError(f"{where}: token id {int(ids.max())} outside the tokenizer's vocabulary of {vocab}")
    if max_length is not None and ids.size > max_length:
        if overlong == "error":
            raise UserError(f"{where}: {ids.size} tokens, more than --max-length {max_length} "
                            "(use --overlong truncate or drop)")
        if overlong == "drop":
            summary.dropped_overlong += 1
            return None
        ids, mask = ids[:max_length], mask[:max_length]
        summary.truncated += 1
    if not mask.any():
        summary.dropped_no_loss += 1
        return None
    return ids, mask


def _summarize(summary: PrepareSummary, lengths: np.ndarray, skipped: SkipCounter, seconds: float) -> None:
    summary.samples = int(lengths.size)
    summary.tokens = int(lengths.sum())
    summary.skipped = dict(skipped.counts)
    summary.length_stats = {
        "min": int(lengths.min()), "mean": float(lengths.mean()), "p50": int(np.percentile(lengths, 50)),
        "p99": int(np.percentile(lengths, 99)), "max": int(lengths.max()),
    }
    summary.seconds = seconds


def _refused(err: BadSample, skip_bad: bool, skipped: SkipCounter) -> None:
    if not skip_bad:
        raise err
    skipped.add(err)


def _count_and_fingerprint(source: Source) -> tuple[int | None, dict]:
    """Rows (None: unknown before reading) and the content fingerprint; a JSONL file read once for both."""
    if source.kind == "jsonl":
        num_lines, sha256 = scan_file(source.path)
        return num_lines, source.fingerprint(sha256)
    return source.count(), source.fingerprint()


def prepare_jsonl(input_path, tokenizer, output_dir, *, max_length: int | None = None,
                  overlong: str = "truncate", skip_bad: bool = False, overwrite: bool = False,
                  progress: bool = True, flag: str = "--output", messages_field: str | None = None,
                  num_proc: int | None = None, split: str | None = None, input_flag: str = "--input") -> PrepareSummary:
    """Tokenize the conversations at `input_path` (any format of `dflash.data.sources`: JSONL,
    JSON, parquet, Arrow, a folder of parquet shards or a `save_to_disk` folder) into a token
    store at `output_dir`.

    `tokenizer` is a loaded tokenizer or a path. Samples longer than `max_length` are truncated,
    dropped or refused as `overlong` says, and counted in the summary. `num_proc` processes
    tokenize (default: `default_num_proc`); the store is the same for any number. The store is
    written to a temporary folder beside `output_dir` and renamed into place, so a failed run
    leaves nothing. An existing `output_dir` is replaced (with `overwrite`) only if it is empty or
    a token store. `flag` names `output_dir` in errors; `messages_field` the conversation column
    of a tabular input (default: `messages` or `conversations`); `split` the split of a folder
    or DatasetDict that holds several; `input_flag` names `input_path`.
    """
    input_path, output_dir = Path(input_path), Path(output_dir)
    _check_arguments(max_length, overlong, num_proc)
    tokenizer_folder = Path(tokenizer) if isinstance(tokenizer, (str, Path)) and Path(tokenizer).exists() else None
    check_apart(output_dir, {input_flag: input_path, "--tokenizer": tokenizer_folder}, flag)  # before the lock
    try:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"{flag} {output_dir}: cannot write in {output_dir.parent} ({os_reason(err)})") from None
    # one writer per store, from the first check to the rename: a second one stops at once
    with OutputLock(output_dir, flag=flag, what="preparation"):
        return _write_store(input_path, tokenizer, output_dir, max_length=max_length, overlong=overlong,
                            skip_bad=skip_bad, overwrite=overwrite, progress=progress, flag=flag,
                            messages_field=messages_field, num_proc=num_proc, split=split, input_flag=input_flag)


def _write_store(input_path: Path, tokenizer, output_dir: Path, *, max_length, overlong, skip_bad, overwrite, progress,
                 flag, messages_field, num_proc, split, input_flag) -> PrepareSummary:
    """`prepare_jsonl`'s work, under the store's lock."""
    import datasets
    from tqdm.auto import tqdm

    datasets.disable_progress_bars()  # ours counts rows; theirs would repeat it per stage
    source = open_source(input_path, messages_field=messages_field, split=split)
    check_replaceable(output_dir, overwrite, flag)
    tok_path = None
    if isinstance(tokenizer, (str, Path)):
        tok_path, tokenizer = str(tokenizer), load_tokenizer(tokenizer)
    num_proc = num_proc or default_num_proc(source)

    summary = PrepareSummary(input=str(input_path), output=str(output_dir), unit=source.unit)
    skipped = SkipCounter()
    vocab = len(tokenizer)
    t0 = time.perf_counter()
    num_lines, fingerprint = _count_and_fingerprint(source)
    # JSONL lines count from 1, rows from 0: the bar shows how many were read
    seen = (lambda index: index) if source.unit == "line" else (lambda index: index + 1)
    unit = f" {source.unit}s"

    def samples():
        with tqdm(total=num_lines, unit=unit, desc=f"tokenizing [{num_proc} process(es)]", disable=not progress,
                  smoothing=0.05) as bar:
            rows = source.rows(skip_bad=skip_bad, skipped=skipped)
            for index, where, result in tokenized(rows, tokenizer, num_proc):
                bar.update(seen(index) - bar.n)
                if len(result) == 3:  # the chat template refused it
                    _refused(BadSample(*result), skip_bad, skipped)
                    continue
                sample = _fit(*result, where, vocab=vocab, max_length=max_length, overlong=overlong,
                              summary=summary)
                if sample is None:
                    continue
                ids, mask = sample
                summary.assistant_tokens += int(mask.sum())
                summary.samples += 1
                yield {"input_ids": ids, "loss_mask": mask, "length": int(ids.size), "supervised": int(mask.sum()),
                       "source_line": index}
            total = num_lines if num_lines is not None else source.rows_read
            bar.update(total - bar.n)
        summary.lines_read = total
        if summary.samples == 0:
            # before `datasets` sees an empty generator (it would fail with no word of why)
            raise UserError(
                f"{input_path}: no usable sample in {total:,} {source.unit}(s) ({summary.dropped_overlong} "
                f"over-long dropped, {summary.dropped_no_loss} with no supervised token left); {skipped.summary()}")

    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("uint8")),
        "length": datasets.Value("int32"),
        "supervised": datasets.Value("int32"),
        "source_line": datasets.Value("int64"),
    })
    try:
        work = partial_folder(output_dir)
    except OSError as err:
        raise UserError(f"{flag} {output_dir}: cannot write in {output_dir.parent} ({os_reason(err)})") from None
    try:
        try:
            ds = datasets.Dataset.from_generator(samples, features=features, cache_dir=str(work / "cache"))
        except datasets.exceptions.DatasetGenerationError as e:
            if isinstance(e.__cause__, UserError):
                raise e.__cause__ from None
            raise
        staged = work / "store"
        ds.save_to_disk(str(staged))
        _summarize(summary, np.asarray(ds["length"], dtype=np.int64), skipped, time.perf_counter() - t0)
        meta = {
            "version": STORE_VERSION,
            "tokenizer": tok_path or getattr(tokenizer, "name_or_path", None),
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "input_fingerprint": fingerprint,
            "input_format": source.kind,
            "settings": settings_of(max_length, overlong, skip_bad, messages_field, split),
            "vocab_size": vocab,
            "max_length": max_length,
            "overlong": overlong,
            "summary": asdict(summary),
        }
        (staged / STORE_META).write_text(json.dumps(meta, indent=2) + "\n")
        del ds
        if output_dir.exists():  # an empty folder or a store (check_replaceable): moved aside, removed below
            os.replace(output_dir, work / "old")
        os.replace(staged, output_dir)
    except Exception as e:
        if disk_full(e):
            raise UserError(f"{output_dir}: the disk is full while writing the token store "
                            f"({free_space(output_dir.parent)}); free some space and run again") from None
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def ensure_store(input_path: Path, tokenizer, store_dir: Path, *, max_length: int, refuse_changes: bool = False,
                 progress: bool = True, say=print, messages_field: str | None = None) -> None:
    """The token store of a run at `store_dir`, prepared from `input_path` (any format of
    `dflash.data.sources`) unless the one there was made of the same input content, tokenizer and
    settings. With `refuse_changes` (a resumed run) a store of other data is an error instead of
    being rebuilt, so nothing is replaced."""
    source = open_source(input_path, messages_field=messages_field, flag="--data")
    settings = settings_of(max_length, "truncate", False, messages_field)
    diffs = store_differences(store_dir, source, tokenizer, settings) if store_dir.exists() else ["none yet"]
    if not diffs:
        return
    if refuse_changes and store_dir.exists():
        refuse_changed_store(store_dir, diffs)
    if store_dir.exists():
        say(f"rebuilding {store_dir}: " + "; ".join(diffs))
    say(f"preparing {input_path} -> {store_dir}")
    summary = prepare_jsonl(input_path, tokenizer, store_dir, max_length=max_length, overlong="truncate",
                            overwrite=True, progress=progress, flag="the run's token store",
                            messages_field=messages_field, input_flag="--data")
    say(summary.text())
