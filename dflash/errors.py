"""User-facing errors: the command-line entry points print them without a traceback."""
from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """Bad input or configuration: the message says what is wrong, where, and how to fix it."""


def say_error(line: str) -> None:
    """One write of the whole line: ranks started with `python -u` share stderr, and print()'s
    separate write of the newline lets another rank's line land in between."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def exit_with_error(line: str):
    """Print `line` and exit with status 2. A rank of several first takes down its process group:
    left to interpreter shutdown, the threads that talk to its peers can die in std::terminate
    (SIGABRT, status 250 instead of 2)."""
    say_error(line)
    dist = sys.modules.get("torch.distributed")  # loaded only if this process uses it
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; the message is out
            pass
    sys.exit(2)


def exit_on_user_error(main):
    """Decorate a CLI `main`: a UserError becomes `error: ...` on stderr and exit status 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as err:
            exit_with_error(f"error: {err}")

    return wrapper


def disk_full(err: BaseException) -> bool:
    """Whether `err`, or an error it was raised from, is a full disk. torch.save reports one as
    a RuntimeError "unexpected pos ..." from its zip writer, with no errno."""
    import errno

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(err, RuntimeError) and "unexpected pos" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def free_space(path) -> str:
    """Free space on the file system of `path` (or its nearest existing parent), for messages."""
    import shutil
    from pathlib import Path

    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return f"{shutil.disk_usage(path).free / 2**30:.2f} GiB free"
