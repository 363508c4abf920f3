"""Command-line values shared by every entry point: one parser for comma-separated lists, the
argparse type of every numeric option of the `launch/` commands (`number`), with its range, and
`Option`, a training option that a drafter kind or a loss term declares."""
from __future__ import annotations

import argparse
import math
import shlex
from itertools import pairwise
from typing import Any, NamedTuple

from dflash.errors import UserError


class Option(NamedTuple):
    """An option a drafter kind or a loss term adds to the training options: its section, default, `--help`
    text and, for a number, the range it must lie in (`check`: (holds, what it must be))."""

    section: str
    default: Any
    help: str
    check: tuple | None = None


def parse_list(text, flag: str, cast=int, *, increasing: bool = False, distinct: bool = False,
               minimum: int | None = None) -> tuple:
    """`"1,9,17"` (or a YAML list) -> a tuple of `cast` values; errors name the flag and the bad item.

    increasing: strictly increasing (bucket boundaries); distinct: no repeats (tapped layers);
    minimum: the smallest value allowed. An empty list is an error: leave the option out instead.
    """
    items = text if isinstance(text, (list, tuple)) else str(text).split(",")
    values = []
    for item in items:
        item = item.strip() if isinstance(item, str) else item
        if item == "":
            continue
        try:
            if isinstance(item, bool) or (cast is int and isinstance(item, float) and not item.is_integer()):
                raise ValueError
            values.append(cast(item))
        except (TypeError, ValueError):
            kind = "an integer" if cast is int else getattr(cast, "expected", "a valid value")
            raise UserError(f"{flag}: {item!r} is not {kind} (expected a comma-separated list, got {text!r})") from None
    if not values:
        raise UserError(f"{flag}: give at least one value")
    if minimum is not None and min(values) < minimum:
        raise UserError(f"{flag}: values must be >= {minimum}, got {text!r}")
    if increasing and any(b <= a for a, b in pairwise(values)):
        raise UserError(f"{flag}: values must be strictly increasing, got {text!r}")
    if distinct and len(set(values)) != len(values):
        raise UserError(f"{flag}: values must not repeat, got {text!r}")
    return tuple(values)


def number(kind=int, *, minimum=None, above=None, maximum=None):
    """The argparse `type` of a numeric option: a finite `kind` (int or float) >= `minimum`, >
    `above`, <= `maximum` (each None: no bound). argparse names the flag in the error, e.g.
    `argument --max-turns: must be >= 1, got -1`. The bounds stay on the function as `bounds`,
    for the test that walks every command's options."""
    def parse(text):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        for bound, holds, words in ((minimum, lambda b: value >= b, ">="), (above, lambda b: value > b, ">"),
                                    (maximum, lambda b: value <= b, "<=")):
            if bound is not None and not holds(bound):
                raise argparse.ArgumentTypeError(f"must be {words} {bound}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's fallback message: "invalid int value"
    parse.bounds = (kind, minimum, above, maximum)
    return parse


GIVEN_AS = "{} given as"  # the namespace attribute of the name an option was given under (`one_name`)


class _Store(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


def one_name(base: type[argparse.Action] | None = None) -> type[argparse.Action]:
    """The argparse action of an option with several names (an older name kept as an alias, as
    `--gpu-memory-gib` of `--memory-gib`): given under two of them it is refused naming both, where
    argparse would keep the last one silently; the name it was given under is kept (`given_as`), so
    that a later error names the option as typed. `base`: the action otherwise (default: store)."""
    class OneName(base or _Store):
        def __call__(self, parser, namespace, values, option_string=None):
            first = getattr(namespace, GIVEN_AS.format(self.dest), None)
            if first is not None and first != option_string:
                parser.error(f"{first} and {option_string} are one option (two names of it): give it once")
            setattr(namespace, GIVEN_AS.format(self.dest), option_string)
            super().__call__(parser, namespace, values, option_string)

    return OneName


def given_as(args, dest: str, name: str) -> str:
    """The name option `dest` was given under on the command line (`one_name`), else its own `name`."""
    return getattr(args, GIVEN_AS.format(dest), None) or name


def split_flags(text: str, where: str) -> list[str]:
    """Flags written as one string (`--recipes 'name: --loss ce=1'`), split as a shell would; a quote
    left open is one line naming `where`, not shlex's traceback."""
    try:
        return shlex.split(text)
    except ValueError as err:
        raise UserError(f"{where}: {text.strip()!r} cannot be split into flags ({str(err).lower()}: a quote left "
                        "open?)") from None
