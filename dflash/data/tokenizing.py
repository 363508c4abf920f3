"""Conversations -> tokens: the tokenizer folder, the assistant-only loss mask found through the chat
template, and the encoding of many conversations in order, by one process or several."""
from __future__ import annotations

import contextlib
import copy
import os
import signal
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dflash.data.conversations import BadSample, render_chat
from dflash.errors import UserError

# files one of which a tokenizer folder must hold
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_tokenizer_files(path: str | Path, flag: str) -> None:
    """A folder with tokenizer files: without them transformers loads an empty tokenizer."""
    if not Path(path).is_dir():
        raise UserError(f"{flag} {path}: no such directory (give a local Hugging Face tokenizer or model folder)")
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"{flag} {path}: no tokenizer files there (none of {', '.join(TOKENIZER_FILES)}); "
                        "copy the model's tokenizer into that folder")


def load_tokenizer(path: str | Path, flag: str = "--tokenizer"):
    """A fast tokenizer with a chat template from a local folder or a .gguf model file (the tokenizer
    it holds); `flag` names the option in errors."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.suffix == ".gguf" and path.is_file():
        folder, extra = path.parent, {"gguf_file": path.name}
    else:
        check_tokenizer_files(path, flag)
        folder, extra = path, {}
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), **extra)
    except (OSError, ValueError) as e:
        raise UserError(f"{flag} {path}: cannot load a tokenizer there ({e})") from None
    if not getattr(tok, "is_fast", False):
        raise UserError(f"{flag} {path}: a fast tokenizer (tokenizer.json) is needed for offsets")
    if not tok.chat_template:
        raise UserError(f"{flag} {path}: the tokenizer has no chat template")
    return tok


def _render(tokenizer, messages, where: str, add_generation_prompt=False) -> str:
    return render_chat(tokenizer, messages, where, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns.

    A turn's span runs from the end of the generation prompt that precedes it to the end of
    the turn (its end-of-turn marker included, so the model learns to stop). Found by rendering
    prefixes, which needs a template whose renderings of prefixes are string prefixes; where a
    template rewrites history (e.g. drops earlier reasoning), the turn's content is searched
    for in the full text instead.
    """
    text = _render(tokenizer, messages, where)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], where, add_generation_prompt=True)
        upto = text if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1], where)
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


class Encoder:
    """What `tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)` computes, as one
    call of the tokenizer's Rust backend per batch of texts (threaded by the backend): transformers'
    per-text call and conversions took half the time of preparing. A copy of the backend, set as
    transformers sets it for such a call (no truncation, no padding, special tokens as the tokenizer
    splits them)."""

    def __init__(self, tokenizer):
        backend = copy.deepcopy(tokenizer.backend_tokenizer)
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
        self.backend = backend

    def __call__(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """`(ids int32, start offset int64)` of each text's tokens."""
        return [(np.asarray(e.ids, dtype=np.int32), np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2)[:, 0])
                for e in self.backend.encode_batch(texts, add_special_tokens=False)]


def loss_mask(starts: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 on the tokens that start inside an assistant span."""
    mask = np.zeros(len(starts), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return mask


def tokenize_conversation(tokenizer, messages, where: str) -> tuple[np.ndarray, np.ndarray]:
    """`(input_ids int32, loss_mask uint8)`: loss on the tokens that start inside an assistant span."""
    text, spans = assistant_spans(tokenizer, messages, where)
    ((ids, starts),) = Encoder(tokenizer)([text])
    return ids, loss_mask(starts, spans)


def tokenize_chunk(tokenizer, encoder: Encoder, chunk: list[tuple[str, list[dict]]]) -> list:
    """`(ids, mask)` per `(where, messages)` of `chunk`, or a refusal as `(where, reason, detail)`
    (BadSample does not pickle); the texts encoded in one batch."""
    rendered = []
    for where, messages in chunk:
        try:
            rendered.append(assistant_spans(tokenizer, messages, where))
        except BadSample as err:
            rendered.append((err.where, err.reason, err.detail))
    texts = [r[0] for r in rendered if len(r) == 2]
    encoded = iter(encoder(texts) if texts else [])
    out = []
    for r in rendered:
        if len(r) == 3:
            out.append(r)
            continue
        ids, starts = next(encoded)
        out.append((ids, loss_mask(starts, r[1])))
    return out


_worker = None  # (tokenizer, encoder) of a tokenizing process


def _start_worker(tokenizer) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # a process per core already: no thread pool in each
    _worker = tokenizer, Encoder(tokenizer)


def _tokenize_chunk(chunk: list[tuple[str, list[dict]]]) -> list:
    return tokenize_chunk(*_worker, chunk)


CHUNK = 64  # conversations per task sent to a tokenizing process (and per encoding batch)
IN_FLIGHT = 4  # tasks per process queued ahead: what bounds memory, whatever the data's size


def _chunks(rows) -> Iterator[tuple[list, BadSample | None]]:
    """`rows` as `(chunk of (index, where, messages), None)`, at most CHUNK each; a bad row the
    reader raises ends the last chunk: `(rows before it, the error)`."""
    chunk = []
    try:
        for index, where, messages, _ in rows:
            chunk.append((index, where, messages))
            if len(chunk) == CHUNK:
                yield chunk, None
                chunk = []
    except BadSample as err:
        yield chunk, err
        return
    if chunk:
        yield chunk, None


@contextlib.contextmanager
def _ignoring_ctrl_c():
    """Processes started in it ignore SIGINT from their first instruction (an ignored signal stays
    ignored across exec, and Python then installs no KeyboardInterrupt handler): Ctrl-C reaches the
    whole process group, and only this process, which stops them, should say so, not each of them
    with a traceback. This process's own handler is back as soon as they are started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def tokenized(rows, tokenizer, num_proc: int) -> Iterator[tuple[int, str, object]]:
    """`(index, where, result)` for each row of `rows` (`Source.rows`), in order: `result` is
    `(ids, mask)` or a refusal `(where, reason, detail)`. With `num_proc` > 1 the rows are tokenized
    by that many processes, at most IN_FLIGHT chunks each ahead of the consumer. Row order, and so
    the store, is the same for every `num_proc`; so is the first error: a bad row found by the
    reader is raised only after the rows before it were yielded."""
    if num_proc <= 1:
        encoder = Encoder(tokenizer)
        for chunk, err in _chunks(rows):
            results = tokenize_chunk(tokenizer, encoder, [(w, m) for _, w, m in chunk])
            for (index, where, _), result in zip(chunk, results, strict=True):
                yield index, where, result
            if err is not None:
                raise err
        return
    import multiprocessing

    # spawn: no copy of the parent's threads (DeepSpeed, gloo, the tokenizer's own pool) and locks
    ctx = multiprocessing.get_context("spawn")
    with _ignoring_ctrl_c():
        pool = ctx.Pool(num_proc, initializer=_start_worker, initargs=(tokenizer,))
    with pool:
        pending: deque = deque()

        def ready():
            heads, task = pending.popleft()
            for (index, where), result in zip(heads, task.get(), strict=True):
                yield index, where, result

        for chunk, err in _chunks(rows):
            if chunk:
                pending.append(([(i, w) for i, w, _ in chunk],
                                pool.apply_async(_tokenize_chunk, ([(w, m) for _, w, m in chunk],))))
            if err is not None:
                while pending:
                    yield from ready()
                raise err
            if len(pending) >= IN_FLIGHT * num_proc:
                yield from ready()
        while pending:
            yield from ready()

