"""Regenerate a conversation dataset with the target: every assistant turn becomes the target's own
response to the turns before it, so the drafter learns the distribution it will be asked to
predict at inference.

Conversations are read with `dflash.data.conversations` (prompt-only files are fine: a
conversation that ends with a user turn gets one response). A conversation with several assistant
turns is regenerated turn by turn, each turn seeing the target's earlier answers as history.

Output: JSONL in the `messages` form, one line per input conversation, in input order, with a
`meta` object saying how it was made (settings, input file and line). One run at a time writes an
output (a lock beside it). Writing is resumable: every batch is appended as whole lines and
synced; a rerun truncates a torn last line, skips the conversations already present (matched by
content: the turns that shape the response and the settings, not by line number) and, because
batches are always the same consecutive groups of valid input lines, regenerates an unfinished
batch exactly as an uninterrupted run would have. When the input file was edited, the lines of
conversations no longer in it are dropped and the changed ones regenerated; an output made of
another input file, or with other settings, is refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from dflash.data.conversations import BadSample, SkipCounter, parse_conversation, render_chat
from dflash.data.generation import stop_ids
from dflash.data.sources import Source, open_source
from dflash.errors import UserError, disk_full, os_reason
from dflash.partial import replace_file, try_lock

BACKENDS = ("auto", "hf", "vllm", "sglang")
DTYPES = ("auto", "float32", "bfloat16", "float16")
THINK_CLOSE = "</think>"
# meta fields that change what is generated: a resumed run must agree with the lines it keeps
SETTINGS = ("target", "temperature", "seed", "max_new_tokens", "keep_thinking")


@dataclass
class RegenerateConfig:
    target: str  # Hugging Face model directory (config, weights, tokenizer with a chat template)
    input: str  # conversations in any format of dflash.data.sources (`messages` or ShareGPT `conversations`)
    output: str  # JSONL written in the `messages` form; appended to when it exists (resume)
    max_new_tokens: int = 2048  # per assistant turn
    temperature: float = 0.0  # 0 = greedy
    seed: int | None = None  # sampling seed; defaults to 0 when temperature > 0
    batch_size: int = 16  # conversations per generation batch
    keep_thinking: bool = False  # keep `<think>...</think>` in stored responses
    skip_bad: bool = False  # skip bad input lines (counted) instead of stopping
    backend: str = "auto"  # auto | hf | vllm | sglang
    dtype: str = "auto"  # auto: bfloat16 on a GPU, float32 on the CPU
    target_name: str | None = None  # what `meta.target` records; defaults to the path as given
    limit: int | None = None  # regenerate only the first `limit` valid conversations
    messages_field: str | None = None  # the input's conversation column (default: messages, else conversations)

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise UserError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature == 0 and self.seed is not None:
            raise UserError("--seed only applies to sampling; give --temperature > 0 or drop --seed")
        if self.backend not in BACKENDS:
            raise UserError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.limit is not None and self.limit < 1:
            raise UserError(f"--limit must be at least 1, got {self.limit}")
        if not (Path(self.target) / "config.json").is_file():
            raise UserError(f"--target {self.target}: not a model directory (no config.json)")
        open_source(self.input, messages_field=self.messages_field)  # the format and columns, one line if wrong
        if Path(self.output).resolve() == Path(self.input).resolve():
            raise UserError("--output must differ from --input")
        if not Path(self.output).resolve().parent.is_dir():
            raise UserError(f"--output {self.output}: the folder {Path(self.output).parent} does not exist")
        if Path(self.output).exists() and not Path(self.output).is_file():
            kind = "a folder" if Path(self.output).is_dir() else "not a regular file"
            raise UserError(f"--output {self.output}: is {kind}; give the path of a JSONL file to write")

    @property
    def sampling_seed(self) -> int | None:
        return (0 if self.seed is None else self.seed) if self.temperature > 0 else None

    def settings(self) -> dict:
        return {
            "target": self.target_name or self.target, "temperature": self.temperature,
            "seed": self.sampling_seed, "max_new_tokens": self.max_new_tokens,
            "keep_thinking": self.keep_thinking,
        }


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens, without the stop token
    hit_limit: bool  # stopped by max_new_tokens, not by an end-of-turn token


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






def _cut(tokens: list[int], stops: list[int], max_new_tokens: int) -> Generation:
    for i, t in enumerate(tokens):
        if t in stops:
            return Generation(tokens[:i], False)
    return Generation(tokens, len(tokens) >= max_new_tokens)


class HFBackend:
    """Hugging Face `generate` on left-padded batches (GPU when there is one, else the CPU)."""

    name = "hf"

    def __init__(self, target: str, tokenizer, dtype: str):
        import torch
        from transformers import GenerationConfig

        from dflash.models.target import load_language_model

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype == "auto":
            dtype = "bfloat16" if self.device == "cuda" else "float32"
        # any TargetModel family; an image-text checkpoint: its language model only
        self.model = load_language_model(target, getattr(torch, dtype), self.device)
        self.model.eval()
        self.stops = stop_ids(tokenizer, self.model.generation_config.eos_token_id)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stops[0]
        # `generate` fills every unset option from the model's generation config (Qwen3 ships
        # top_k/top_p/temperature); a bare one makes greedy plain argmax and sampling plain
        # temperature sampling.
        self.model.generation_config = GenerationConfig(eos_token_id=self.stops, pad_token_id=self.pad)

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                 seeds: list[int] | None) -> list[Generation]:
        from transformers import GenerationConfig

        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=temperature > 0, eos_token_id=self.stops, pad_token_id=self.pad,
            **({"temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}),
        )
        if seeds is not None:
            # `generate` draws from the global generator: one seed per batch is all it can take
            torch.manual_seed(seeds[0])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=config
            )
        new = out[:, width:].tolist()
        return [_cut(row, self.stops, max_new_tokens) for row in new]


class VLLMBackend:
    """vLLM offline engine, fed token ids (so it sees exactly the rendered chat template)."""

    name = "vllm"

    def __init__(self, target: str, tokenizer, dtype: str, seed: int | None):
        from vllm import LLM

        from dflash.models.target_spec import load_target_spec

        self.llm = LLM(model=target, dtype=dtype, seed=seed or 0)
        self.stops = stop_ids(tokenizer, load_target_spec(target).generation_eos())

    def generate(self, prompts, *, max_new_tokens, temperature, seeds) -> list[Generation]:
        from vllm import SamplingParams

        params = [
            SamplingParams(
                temperature=temperature, top_p=1.0, max_tokens=max_new_tokens, seed=None if seeds is None else seeds[i],
                stop_token_ids=self.stops, skip_special_tokens=False,
            )
            for i in range(len(prompts))
        ]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [_cut(list(o.outputs[0].token_ids), self.stops, max_new_tokens) for o in outs]


class SGLangBackend:
    """SGLang offline engine, fed token ids."""

    name = "sglang"

    def __init__(self, target: str, tokenizer, dtype: str, seed: int | None):
        import sglang

        from dflash.models.target_spec import load_target_spec

        self.engine = sglang.Engine(model_path=target, dtype=dtype, random_seed=seed or 0, log_level="error")
        self.stops = stop_ids(tokenizer, load_target_spec(target).generation_eos())

    def generate(self, prompts, *, max_new_tokens, temperature, seeds) -> list[Generation]:
        params = [
            {
                "temperature": temperature, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens,
                "stop_token_ids": self.stops, "skip_special_tokens": False,
                **({} if seeds is None else {"sampling_seed": seeds[i]}),
            }
            for i in range(len(prompts))
        ]
        outs = self.engine.generate(input_ids=prompts, sampling_params=params)
        return [
            Generation(_cut(list(o["output_ids"]), self.stops, max_new_tokens).token_ids,
                       o["meta_info"]["finish_reason"]["type"] == "length")
            for o in outs
        ]


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def choose_backend(name: str) -> str:
    """`auto`: vLLM when it is installed and a GPU is present, otherwise Hugging Face."""
    if name == "auto":
        import torch

        return "vllm" if _importable("vllm") and torch.cuda.is_available() else "hf"
    if name in ("vllm", "sglang") and not _importable(name):
        raise UserError(f"--backend {name}: {name} is not installed (use --backend hf or auto)")
    return name


def load_backend(cfg: RegenerateConfig, tokenizer):
    name = choose_backend(cfg.backend)
    if name == "hf":
        return HFBackend(cfg.target, tokenizer, cfg.dtype)
    dtype = "auto" if cfg.dtype == "auto" else cfg.dtype
    cls = VLLMBackend if name == "vllm" else SGLangBackend
    return cls(cfg.target, tokenizer, dtype, cfg.sampling_seed)


def load_tokenizer(target: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    if not tokenizer.chat_template:
        raise UserError(f"--target {target}: the tokenizer has no chat template")
    return tokenizer


class OutputLock:
    """An exclusive lock on `--output` for the life of a run (`.NAME.lock` beside it, holding
    pid@host), so that two runs never write one output; the lock file goes when the run ends."""

    def __init__(self, output: Path):
        self.path = output.with_name(f".{output.name}.lock")
        self.output = output
        self._fd = None

    def __enter__(self):
        while True:
            try:
                fd, holder = try_lock(self.path)
            except OSError as err:
                raise UserError(f"--output {self.output}: cannot write in {self.path.parent} ({os_reason(err)})") \
                    from None
            if fd is None:
                raise UserError(f"--output {self.output}: another regenerate run is writing it (process {holder}); "
                                "wait for it to end, or choose another --output")
            # the previous holder may have removed the file between our open and our lock
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode())
        except OSError as err:
            self.__exit__()
            raise UserError(f"--output {self.output}: cannot write in {self.path.parent} "
                            f"({os_reason(err, self.path)})") from None
        return self

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)  # still locked: whoever opens it now fails, or finds it gone
        os.close(self._fd)


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
    return _dump(row)


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


def _assistant_slots(messages: list[dict]) -> list[int]:
    """Indices of the turns to generate: every assistant turn, and one after a final user turn."""
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return slots + [len(messages)] if messages[-1]["role"] == "user" else slots


def renderable(samples: Iterator, tokenizer, skip_bad: bool, skipped: SkipCounter) -> Iterator:
    """The samples (`Source.rows`) whose every prompt the chat template renders, as `(index, messages,
    raw)`; the others are a BadSample naming their line or row (or, with skip_bad, counted), before
    any of them reaches the model."""
    for lineno, where, messages, raw in samples:
        try:
            for slot in _assistant_slots(messages):
                render_chat(tokenizer, messages[:slot], where, add_generation_prompt=True)
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
    return _dump({"messages": messages, **extra, "meta": meta})


def _dump(row: dict) -> bytes:
    """One JSONL line, UTF-8; text that is not (a lone surrogate escape in a field of the input line
    that is copied) stays escaped."""
    try:
        return (json.dumps(row, ensure_ascii=False) + "\n").encode()
    except UnicodeEncodeError:
        return (json.dumps(row) + "\n").encode()


def _sort_output(output: Path) -> None:
    """Rewrite `output` in input order (by meta.source_line), all or nothing; a crash before it
    leaves complete lines in another order, which a rerun sorts."""
    lines = output.read_bytes().splitlines(keepends=True)
    lines.sort(key=lambda line: json.loads(line)["meta"]["source_line"])
    try:
        replace_file(output, lines)
    except OSError as err:
        raise UserError(f"--output {output}: cannot rewrite it in input order ({os_reason(err, output)}); every "
                        "line is written: rerun the same command to sort it") from None


def _write_all(fd: int, data: bytes) -> None:
    """os.write may write part of `data` (a disk filling up): write the rest, or raise."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


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
    with OutputLock(output):
        return _regenerate(cfg, output, backend, tokenizer, progress, say)


def _regenerate(cfg: RegenerateConfig, output: Path, backend, tokenizer, progress: bool, say) -> dict:
    settings = cfg.settings()
    source_data = open_source(cfg.input, messages_field=cfg.messages_field)
    done, dropped = resume_output(output, cfg, settings, say, source_data)
    tokenizer = tokenizer or load_tokenizer(cfg.target)
    backend = backend or load_backend(cfg, tokenizer)
    skipped = SkipCounter()
    samples = renderable(source_data.rows(skip_bad=cfg.skip_bad, skipped=skipped, require_assistant=False),
                         tokenizer, cfg.skip_bad, skipped)
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
                _write_all(fd, b"".join(lines))
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
        _sort_output(output)
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

