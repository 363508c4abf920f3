"""Command-line values shared by every entry point: one parser for comma-separated lists."""
from __future__ import annotations

from itertools import pairwise

from dflash.errors import UserError


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
