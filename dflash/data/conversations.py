"""Reading conversations from JSONL: the `messages` form and the ShareGPT form.

Each line is one JSON object, either `{"messages": [{"role": ..., "content": ...}, ...]}` or
`{"conversations": [{"from": ..., "value": ...}, ...]}`. Both become a list of
`{"role", "content"}` dicts with roles `system`, `user`, `assistant`. A bad line is reported
with its file and line number; with `skip_bad` it is counted by reason instead.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dflash.errors import UserError

ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
}


class BadSample(UserError):
    """A line that cannot be used; `reason` is a short key used to count skipped lines."""

    def __init__(self, where: str, reason: str, detail: str):
        super().__init__(f"{where}: {detail}")
        self.where, self.reason, self.detail = where, reason, detail


def parse_conversation(obj, where: str, *, require_assistant: bool = True) -> list[dict]:
    """Normalise one decoded JSON line to `[{"role", "content"}, ...]`; raise BadSample."""
    if not isinstance(obj, dict):
        raise BadSample(where, "not an object", f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        turns, role_key, text_key = obj["messages"], "role", "content"
    elif "conversations" in obj:
        turns, role_key, text_key = obj["conversations"], "from", "value"
    else:
        raise BadSample(
            where, "missing messages",
            f"no 'messages' or 'conversations' field (keys: {sorted(obj)[:8]}); expected "
            '{"messages": [{"role": "user", "content": "..."}, ...]}',
        )
    if not isinstance(turns, list) or not turns:
        raise BadSample(where, "empty conversation", "the conversation has no turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise BadSample(
                where, "malformed turn", f"turn {i} must be an object with '{role_key}' and '{text_key}'"
            )
        role = ROLES.get(str(turn[role_key]).lower())
        if role is None:
            raise BadSample(
                where, "unknown role",
                f"turn {i} has unknown role {turn[role_key]!r} (known: {', '.join(sorted(ROLES))})",
            )
        content = turn[text_key]
        if not isinstance(content, str):
            raise BadSample(where, "malformed turn", f"turn {i}: '{text_key}' must be a string")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON allows "\ud800"; no tokenizer can encode it
            raise BadSample(where, "not text", f"turn {i}: {e.object[e.start:e.end]!r} at character {e.start} is "
                            "not text (an unpaired surrogate escape); the tokenizer cannot encode it") from None
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in messages):
        raise BadSample(where, "no user turn", "the conversation has no user turn")
    first = next(m["role"] for m in messages if m["role"] != "system")
    if first != "user":
        # an opening assistant turn answers nothing; chat templates cannot render a prompt for it
        raise BadSample(where, "assistant first", "the first turn after the system prompt must be the user's, "
                        "not the assistant's")
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadSample(where, "no assistant turn", "the conversation has no assistant turn (nothing to learn)")
    return messages


@dataclass
class SkipCounter:
    """What `--skip-bad` skipped, by reason, with the first example of each."""

    counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def add(self, err: BadSample) -> None:
        self.counts[err.reason] += 1
        self.examples.setdefault(err.reason, str(err))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        if not self.total:
            return "skipped: none"
        lines = [f"skipped {self.total} bad line(s):"]
        for reason, n in self.counts.most_common():
            lines.append(f"  {n:>8}  {reason}  (first: {self.examples[reason]})")
        return "\n".join(lines)


def render_chat(tokenizer, messages: list[dict], where: str, *, add_generation_prompt: bool = False) -> str:
    """The chat template's text for `messages`; a template that refuses them is a BadSample."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        # e.g. a template's raise_exception('...') on a role order it does not accept
        raise BadSample(where, "template", f"the chat template refuses this conversation: {e}") from None


def read_conversations(
    path: str | Path, *, skip_bad: bool = False, skipped: SkipCounter | None = None,
    require_assistant: bool = True,
) -> Iterator[tuple[int, list[dict], dict]]:
    """Yield `(line_number, messages, raw_object)` for every usable line of a JSONL file.

    Blank lines are ignored. Without `skip_bad` the first bad line raises BadSample naming
    `path:line`; with it, bad lines go to `skipped`.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    with path.open("rb") as f:  # decoded line by line, so that bad UTF-8 is reported with its line
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadSample(where, "invalid UTF-8", f"invalid UTF-8 at byte {e.start} of the line "
                                    f"({raw[e.start:e.start + 4]!r})") from None
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BadSample(where, "invalid JSON", f"invalid JSON ({e.msg} at column {e.colno})") from None
                messages = parse_conversation(obj, where, require_assistant=require_assistant)
            except BadSample as err:
                if not skip_bad:
                    raise
                if skipped is not None:
                    skipped.add(err)
                continue
            yield lineno, messages, obj
