"""User-facing errors: the command-line entry points print them without a traceback."""
from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """Bad input or configuration: the message says what is wrong, where, and how to fix it."""


def exit_on_user_error(main):
    """Decorate a CLI `main`: a UserError becomes `error: ...` on stderr and exit status 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    return wrapper
