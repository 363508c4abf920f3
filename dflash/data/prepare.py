"""raw conversations (JSONL) -> token store: chat template, assistant-only loss mask, lengths."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dflash.data.conversations import BadSample, SkipCounter, read_conversations
from dflash.data.token_store import STORE_META, STORE_VERSION
from dflash.errors import UserError

OVERLONG = ("truncate", "drop", "error")


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    if not Path(path).exists():
        raise UserError(f"--tokenizer {path}: no such directory (give a local Hugging Face tokenizer or model folder)")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise UserError(f"--tokenizer {path}: cannot load a tokenizer there ({e})") from None
    if not getattr(tok, "is_fast", False):
        raise UserError(f"--tokenizer {path}: a fast tokenizer (tokenizer.json) is needed for offsets")
    if not tok.chat_template:
        raise UserError(f"--tokenizer {path}: the tokenizer has no chat template")
    return tok


def count_lines(path: Path) -> int:
    """Lines in a file (a last line without a newline counts), read in 16 MiB chunks."""
    count, last = 0, b"\n"
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns.

    A turn's span runs from the end of the generation prompt that precedes it to the end of
    the turn (its end-of-turn marker included, so the model learns to stop). Found by rendering
    prefixes, which needs a template whose renderings of prefixes are string prefixes; where a
    template rewrites history (e.g. drops earlier reasoning), the turn's content is searched
    for in the full text instead.
    """
    text = _render(tokenizer, messages)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1])
        if upto.startswith(before) and text.startswith(upto) and len(before) >= cursor:
            spans.append((len(before), len(upto)))
            cursor = len(upto)
            continue
        start = text.find(m["content"], cursor) if m["content"] else -1
        if start < 0:
            raise BadSample(where, "template", f"assistant turn {i} cannot be located in the chat-template output")
        end = start + len(m["content"])
        eos = tokenizer.eos_token or ""
        if eos and text.startswith(eos, end):
            end += len(eos)
        spans.append((start, end))
        cursor = end
    return text, spans


def tokenize_conversation(tokenizer, messages, where: str) -> tuple[np.ndarray, np.ndarray]:
    """`(input_ids int32, loss_mask uint8)`: loss on the tokens that start inside an assistant span."""
    text, spans = assistant_spans(tokenizer, messages, where)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return ids, mask


@dataclass
class PrepareSummary:
    input: str
    output: str
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
            f"  lines read: {self.lines_read:,}",
            f"  over-long: {self.truncated:,} truncated, {self.dropped_overlong:,} dropped",
            f"  dropped with no supervised token left: {self.dropped_no_loss:,}",
        ]
        if self.skipped:
            lines.append(f"  skipped bad lines: {sum(self.skipped.values()):,} "
                         + ", ".join(f"{k}: {v}" for k, v in self.skipped.items()))
        if self.length_stats:
            s = self.length_stats
            lines.append(f"  lengths: min {s['min']}, mean {s['mean']:.0f}, p50 {s['p50']}, p99 {s['p99']}, max {s['max']}")
        return "\n".join(lines)


def prepare_jsonl(input_path, tokenizer, output_dir, *, max_length: int | None = None,
                  overlong: str = "truncate", skip_bad: bool = False, overwrite: bool = False,
                  progress: bool = True) -> PrepareSummary:
    """Tokenize a JSONL file of conversations into a token store at `output_dir`.

    `tokenizer` is a loaded tokenizer or a path. Samples longer than `max_length` are truncated,
    dropped or refused as `overlong` says, and counted in the summary. The store is written to
    a temporary folder beside `output_dir` and renamed into place, so a failed run leaves nothing.
    """
    import datasets
    from tqdm.auto import tqdm

    datasets.disable_progress_bars()  # ours counts lines; theirs would repeat it per stage

    if overlong not in OVERLONG:
        raise UserError(f"--overlong must be one of {', '.join(OVERLONG)}; got {overlong!r}")
    if max_length is not None and max_length < 2:
        raise UserError(f"--max-length must be >= 2, got {max_length}")
    input_path, output_dir = Path(input_path), Path(output_dir)
    if not input_path.is_file():
        raise UserError(f"--input {input_path}: no such file")
    if output_dir.exists() and not overwrite:
        raise UserError(f"--output {output_dir} already exists; choose another folder or pass --overwrite")
    tok_path = None
    if isinstance(tokenizer, (str, Path)):
        tok_path, tokenizer = str(tokenizer), load_tokenizer(tokenizer)

    summary = PrepareSummary(input=str(input_path), output=str(output_dir))
    skipped = SkipCounter()
    vocab = len(tokenizer)
    t0 = time.perf_counter()

    def samples():
        with tqdm(total=count_lines(input_path), unit=" lines", desc="tokenizing", disable=not progress) as bar:
            for lineno, messages, _ in read_conversations(input_path, skip_bad=skip_bad, skipped=skipped):
                bar.update(lineno - bar.n)
                where = f"{input_path}:{lineno}"
                try:
                    ids, mask = tokenize_conversation(tokenizer, messages, where)
                except BadSample as err:
                    if not skip_bad:
                        raise
                    skipped.add(err)
                    continue
                if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                    raise UserError(f"{where}: token id {int(ids.max())} outside the tokenizer's vocabulary of {vocab}")
                if max_length is not None and ids.size > max_length:
                    if overlong == "error":
                        raise UserError(f"{where}: {ids.size} tokens, more than --max-length {max_length} "
                                        "(use --overlong truncate or drop)")
                    if overlong == "drop":
                        summary.dropped_overlong += 1
                        continue
                    ids, mask = ids[:max_length], mask[:max_length]
                    summary.truncated += 1
                if not mask.any():
                    summary.dropped_no_loss += 1
                    continue
                summary.assistant_tokens += int(mask.sum())
                yield {"input_ids": ids, "loss_mask": mask, "length": int(ids.size), "supervised": int(mask.sum()),
                       "source_line": lineno}
            bar.update(bar.total - bar.n)
        summary.lines_read = bar.total

    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("uint8")),
        "length": datasets.Value("int32"),
        "supervised": datasets.Value("int32"),
        "source_line": datasets.Value("int64"),
    })
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.partial-", dir=output_dir.parent))
    try:
        try:
            ds = datasets.Dataset.from_generator(samples, features=features, cache_dir=str(work / "cache"))
        except datasets.exceptions.DatasetGenerationError as e:
            if isinstance(e.__cause__, UserError):
                raise e.__cause__ from None
            raise
        if len(ds) == 0:
            raise UserError(f"{input_path}: no usable sample (summary: {skipped.summary()})")
        staged = work / "store"
        ds.save_to_disk(str(staged))
        lengths = np.asarray(ds["length"], dtype=np.int64)
        summary.samples = int(lengths.size)
        summary.tokens = int(lengths.sum())
        summary.skipped = dict(skipped.counts)
        summary.length_stats = {
            "min": int(lengths.min()), "mean": float(lengths.mean()), "p50": int(np.percentile(lengths, 50)),
            "p99": int(np.percentile(lengths, 99)), "max": int(lengths.max()),
        }
        summary.seconds = time.perf_counter() - t0
        meta = {
            "version": STORE_VERSION,
            "tokenizer": tok_path or getattr(tokenizer, "name_or_path", None),
            "vocab_size": vocab,
            "max_length": max_length,
            "overlong": overlong,
            "summary": asdict(summary),
        }
        (staged / STORE_META).write_text(json.dumps(meta, indent=2) + "\n")
        del ds
        if output_dir.exists():
            shutil.rmtree(output_dir)
        os.replace(staged, output_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summary
