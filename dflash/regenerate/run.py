"""A regeneration run: conversations read and checked, batched, every assistant turn generated turn
by turn (each seeing the target's earlier answers), and the lines written through
`dflash.regenerate.output`; the summary it prints.
"""
from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from dflash.data.conversations import BadSample, SkipCounter, render_chat
from dflash.data.sources import Source, open_source
from dflash.errors import UserError, disk_full, os_reason
from dflash.partial import OutputLock
from dflash.regenerate.config import RegenerateConfig
from dflash.regenerate.engines import Generation, load_backend, load_tokenizer
from dflash.regenerate.output import dump_line, resume_output, sort_output, write_all

THINK_CLOSE = "</think>"


def strip_thinking(text: str) -> str:
    """Drop a `<think>...</think>` part, as Qwen3 chat templates do for earlier turns."""
    if THINK_CLOSE not in text:
        return text
    return text.split(THINK_CLOSE)[-1].lstrip()


def _derived_seed(seed: int, *parts: int) -> int:
    """A distinct, reproducible seed per (batch or request, turn), so a resumed run draws the same
    random numbers for a batch as an uninterrupted one and batches are not correlated."""
    h = seed
    for p in parts:
        h = (h * 1_000_003 + p + 1) % (2**31 - 1)
    return h


def _assistant_slots(messages: list[dict]) -> list[int]:
    """Indices of the turns to generate: every assistant turn, and one after a final user turn."""
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return slots + [len(messages)] if messages[-1]["role"] == "user" else slots


def renderable(samples: Iterator, tokenizer, skip_bad: bool, skipped: SkipCounter,
               positions: int | None = None) -> Iterator:
    """The samples (`Source.rows`) whose every prompt the chat template renders, and whose last
    prompt leaves the target a position to generate at (`positions`: its max_position_embeddings),
    as `(index, messages, raw)`; the others are a BadSample naming their line or row (or, with
    skip_bad, counted), before any of them reaches the model."""
    for lineno, where, messages, raw in samples:
        try:
            for slot in _assistant_slots(messages):
                render_chat(tokenizer, messages[:slot], where, add_generation_prompt=True)
            if positions:
                _check_positions(tokenizer, messages, where, positions)
        except BadSample as err:
            if not skip_bad:
                raise
            skipped.add(err)
            continue
        yield lineno, messages, raw


def _batches(samples: Iterator, size: int, limit: int | None) -> Iterator[list]:
    batch = []
    for n, sample in enumerate(samples):
        if limit is not None and n >= limit:
            break
        batch.append(sample)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _check_positions(tokenizer, messages: list[dict], where: str, positions: int) -> None:
    """The last prompt with every assistant turn empty (what it holds at least, whatever is
    generated) must leave a position to generate at."""
    last = _assistant_slots(messages)[-1]
    bare = [{**m, "content": ""} if m["role"] == "assistant" else m for m in messages[:last]]
    text = render_chat(tokenizer, bare, where, add_generation_prompt=True)
    length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    if length >= positions:
        raise BadSample(where, "past the positions", f"the prompt of its last turn holds at least {length:,} tokens "
                        f"without its responses, past the target's {positions:,} positions "
                        "(max_position_embeddings): nothing can be generated there")


def regenerate_batch(backend, tokenizer, batch: list[list[dict]], cfg: RegenerateConfig,
                     batch_key: int) -> tuple[list[list[dict]], list[list[Generation]]]:
    """Regenerate every assistant turn of each conversation in `batch`.

    Turn r of all conversations is generated in one call, with the earlier turns already replaced,
    so each response is conditioned on the target's own history. A conversation ending in a user
    turn gets one more response. Returns the new conversations and the generations per turn.
    """
    convs, slots = [], []
    for messages in batch:
        conv = [dict(m) for m in messages]
        slots.append(_assistant_slots(conv))
        if conv[-1]["role"] == "user":
            conv.append({"role": "assistant", "content": ""})
        convs.append(conv)
    gens: list[list[Generation]] = [[] for _ in batch]
    for turn in range(max(len(s) for s in slots)):
        todo = [b for b in range(len(batch)) if turn < len(slots[b])]
        prompts = []
        for b in todo:
            text = tokenizer.apply_chat_template(
                convs[b][: slots[b][turn]], tokenize=False, add_generation_prompt=True
            )
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        seed = cfg.sampling_seed
        seeds = None if seed is None else [_derived_seed(seed, batch_key, b, turn) for b in todo]
        outs = backend.generate(
            prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seeds=seeds
        )
        for b, g in zip(todo, outs, strict=True):
            text = tokenizer.decode(g.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            convs[b][slots[b][turn]]["content"] = text if cfg.keep_thinking else strip_thinking(text)
            gens[b].append(g)
    return convs, gens


def _record(raw: dict, lineno: int, messages: list[dict], gens: list[Generation], settings: dict,
            backend: str, source: str) -> bytes:
    extra = {k: v for k, v in raw.items() if k not in ("messages", "conversations", "meta")}
    meta = {
        "source_line": lineno, **settings, "backend": backend,
        "hit_limit": any(g.hit_limit for g in gens),
        "response_tokens": [len(g.token_ids) for g in gens],
        "source": source,
    }
    return dump_line({"messages": messages, **extra, "meta": meta})


def _count_rows(source: Source) -> int | None:
    """Non-blank lines of a JSONL input, rows of the others (None: unknown before reading)."""
    if source.kind != "jsonl":
        return source.count()
    with source.path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def regenerate(cfg: RegenerateConfig, *, backend=None, tokenizer=None, progress: bool = True,
               say=print) -> dict:
    """Run (or resume) a regeneration. Returns counts and timings for the summary.

    `backend`/`tokenizer` may be passed in to reuse a loaded model (benchmarks, tests).
    """
    cfg.validate()
    output = Path(cfg.output)
    with OutputLock(output, what="regenerate run"):
        return _regenerate(cfg, output, backend, tokenizer, progress, say)


def _regenerate(cfg: RegenerateConfig, output: Path, backend, tokenizer, progress: bool, say) -> dict:
    # the target by content (`dflash.identity`): a resume against changed weights is refused
    settings = {**cfg.settings(), "target_sha256": cfg.target_spec.fingerprint()["sha256"]}
    source_data = open_source(cfg.input, messages_field=cfg.messages_field, split=cfg.split)
    done, dropped = resume_output(output, cfg, settings, say, source_data)
    tokenizer = tokenizer or load_tokenizer(cfg.target, cfg.target_spec)
    positions = cfg.target_spec.positions
    if not cfg.skip_bad:  # every prompt checked before the weights load: a bad one is named now, not hours in
        checked = SkipCounter()
        rows = source_data.rows(skip_bad=False, skipped=checked, require_assistant=False)
        for _ in itertools.islice(renderable(rows, tokenizer, False, checked, positions), cfg.limit):
            pass
    backend = backend or load_backend(cfg, tokenizer)
    skipped = SkipCounter()
    samples = renderable(source_data.rows(skip_bad=cfg.skip_bad, skipped=skipped, require_assistant=False),
                         tokenizer, cfg.skip_bad, skipped, positions)
    total = _count_rows(source_data)
    if cfg.limit is not None:
        total = cfg.limit if total is None else min(total, cfg.limit)
    source = str(Path(cfg.input).resolve())
    stats = {"backend": backend.name, "written": 0, "resumed": len(done), "dropped": dropped, "new_tokens": 0,
             "hit_limit": 0, "seconds": 0.0}
    created = not output.exists()
    try:
        fd = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as err:
        raise UserError(f"--output {output}: cannot write it ({os_reason(err)})") from None
    initial = len(done) if total is None else min(len(done), total)
    bar = tqdm(total=total, initial=initial, unit="sample", desc=f"regenerate [{backend.name}]",
               disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()
    counted_skips = read = 0
    last, unsorted = max(done, default=0), False  # lines are appended: after an edit, not in input order
    try:
        for batch in _batches(samples, cfg.batch_size, cfg.limit):
            read += len(batch)
            bar.update(skipped.total - counted_skips)  # bad lines read while filling this batch
            counted_skips = skipped.total
            todo = [lineno not in done for lineno, _, _ in batch]
            if not any(todo):
                continue
            # The whole batch is generated even when a crash left part of it written, so every
            # line sees the same padding and random draws as in an uninterrupted run.
            convs, gens = regenerate_batch(backend, tokenizer, [m for _, m, _ in batch], cfg, batch[0][0])
            lines = [
                _record(raw, lineno, conv, g, settings, backend.name, source)
                for (lineno, _, raw), conv, g, new in zip(batch, convs, gens, todo, strict=True) if new
            ]
            # Whole lines, then fsync: a crash loses at most this batch; a full disk cuts it off
            size = os.fstat(fd).st_size
            try:
                write_all(fd, b"".join(lines))
                os.fsync(fd)
            except OSError as err:
                os.ftruncate(fd, size)
                raise UserError(f"--output {output}: {os_reason(err, output)}; the {len(done)} "
                                "conversation(s) written so far are complete: rerun the same command to resume"
                                + (" once there is space" if disk_full(err) else "")) from None
            new_lines = [lineno for (lineno, _, _), new in zip(batch, todo, strict=True) if new]
            done.update(new_lines)
            unsorted |= new_lines[0] < last
            last = max(last, new_lines[-1])
            stats["written"] += len(lines)
            new_gens = [g for g, new in zip(gens, todo, strict=True) if new]
            stats["new_tokens"] += sum(sum(len(x.token_ids) for x in g) for g in new_gens)
            stats["hit_limit"] += sum(any(x.hit_limit for x in g) for g in new_gens)
            elapsed = time.perf_counter() - start
            bar.update(len(lines))
            bar.set_postfix(tok_s=f"{stats['new_tokens'] / elapsed:.0f}")
    finally:
        os.close(fd)
        bar.close()
    if unsorted:
        sort_output(output)
    if not read:
        if created and output.stat().st_size == 0:
            output.unlink()  # ours, and empty: nothing to resume
        raise UserError(f"{cfg.input}: no usable conversation; {skipped.summary()}")
    stats["seconds"] = time.perf_counter() - start
    stats["skipped"] = skipped
    return stats


def summary(stats: dict, output: str) -> str:
    secs = max(stats["seconds"], 1e-9)
    lines = [
        f"backend: {stats['backend']}",
        f"wrote {stats['written']} conversation(s) to {output}"
        + (f" (resumed: {stats['resumed']} already there)" if stats["resumed"] else "")
        + (f"; dropped {stats['dropped']} no longer in the input" if stats.get("dropped") else ""),
        f"{stats['new_tokens']} new tokens in {stats['seconds']:.1f}s: "
        f"{stats['written'] / secs:.2f} samples/s, {stats['new_tokens'] / secs:.0f} tokens/s",
        f"hit the --max-new-tokens limit: {stats['hit_limit']}",
        stats["skipped"].summary(),
    ]
    return "\n".join(lines)
