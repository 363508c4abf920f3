"""Temporary folders beside what is being written, renamed into place when complete.

`.NAME.partial-XXXX` beside `NAME` is marked with its owner (pid and host). A process killed
while writing leaves it behind; the next writer of `NAME` removes the folders of dead owners on
this host, and leaves alone unmarked ones (not ours) and those of live processes.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

OWNER = "dflash_partial.json"


def partial_folder(output_dir: Path) -> Path:
    """A temporary folder beside `output_dir`, marked with its owner; those of dead owners (a
    killed run) are removed first. Unmarked folders are not ours and are left alone."""
    prefix = f".{output_dir.name}.partial-"
    host = socket.gethostname()
    for old in output_dir.parent.glob(prefix + "*"):
        try:
            owner = json.loads((old / OWNER).read_text())
        except (OSError, ValueError):
            continue
        if owner.get("host") == host and not _alive(int(owner.get("pid", 0))):
            shutil.rmtree(old, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=output_dir.parent))
    (work / OWNER).write_text(json.dumps({"pid": os.getpid(), "host": host}) + "\n")
    return work


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def replace_file(path: Path, chunks) -> None:
    """Write `chunks` (bytes) to `path` all or nothing: into `.NAME.partial-XXXX` beside it, synced,
    then renamed over it (and the rename synced). On any failure (a full disk) the temporary file
    is removed and `path` is as it was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.partial-", dir=path.parent)
    try:
        os.fchmod(fd, path.stat().st_mode & 0o777 if path.exists() else 0o644)  # mkstemp's is 0600
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):  # named by the file being written, not the temporary one
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    sync_folder(path.parent)


def write_json(path: Path, value) -> None:
    """`value` as indented JSON in `path`, all or nothing (`replace_file`)."""
    replace_file(path, [(json.dumps(value, indent=2) + "\n").encode()])


def sync_folder(path: Path) -> None:
    """fsync a folder, so that a rename in it reaches the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def try_lock(path: Path) -> tuple[int | None, str]:
    """Open `path` (made if missing) and take an exclusive lock on it without waiting: (fd, "")
    once held, or (None, what the holder wrote in it) when another process holds it. OSError of
    the open goes to the caller, who names the flag."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 128).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        return None, holder
    return fd, ""
