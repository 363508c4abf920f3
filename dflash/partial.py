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

from dflash.errors import UserError

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


def file_mode() -> int:
    """The mode a new file gets under this process's umask (0644 under the usual 022): for files a
    library writes with a mode of its own (safetensors: 0600) or a temporary one renamed into place
    (mkstemp: 0600), which others (a serving engine run as another user) must read as any file."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def replace_file(path: Path, chunks) -> None:
    """Write `chunks` (bytes) to `path` all or nothing: into `.NAME.partial-XXXX` beside it, synced,
    then renamed over it (and the rename synced). On any failure (a full disk) the temporary file
    is removed and `path` is as it was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.partial-", dir=path.parent)
    try:
        os.fchmod(fd, path.stat().st_mode & 0o777 if path.exists() else file_mode())  # mkstemp's is 0600
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


class OutputLock:
    """An exclusive lock on an output (a file or a folder) for the life of its writer, taken before
    any work: two writers never write one output, the second stops at once naming the first. The
    one lock of every writer (train, prepare, capture, regenerate, build_real_bench). The lock file
    holds pid@host: `.NAME.lock` beside the output, or with `inside` (a folder that stays, as a run
    folder) `.dflash.lock` in it. The lock file goes when the writer ends; a killed writer's lock
    is released with its process (`flock`)."""

    def __init__(self, output: Path, *, flag: str = "--output", what: str = "run", inside: bool = False):
        self.output, self.flag, self.what = Path(output), flag, what
        self.path = self.output / ".dflash.lock" if inside else self.output.with_name(f".{self.output.name}.lock")
        self._fd = None

    def _cannot_write(self, err: OSError):
        from dflash.errors import os_reason

        return UserError(f"{self.flag} {self.output}: cannot write in {self.path.parent} ({os_reason(err)}); "
                         f"choose another {self.flag}")

    def __enter__(self):

        while True:
            try:
                fd, holder = try_lock(self.path)
            except OSError as err:
                raise self._cannot_write(err) from None
            if fd is None:
                raise UserError(f"{self.flag} {self.output}: another {self.what} is writing it (process {holder}); "
                                f"wait for it to end, or choose another {self.flag}")
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
            raise self._cannot_write(err) from None
        return self

    def __exit__(self, *exc):
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # still locked: whoever opens it now fails, or finds it gone
        os.close(self._fd)
        self._fd = None


# --- What a command writes: apart from what it reads, and deleted only where dflash wrote it ---

WRITER_MARK = ".dflash_writer.json"  # {"writer": "launch/train.py"}: the folder was made by that command


def _relation(output: Path, input_: Path) -> str | None:
    """How `output` lies against `input_` (links resolved): "is", "lies inside", "holds", or None."""
    output, input_ = output.resolve(), input_.resolve()
    if output == input_:
        return "is"
    if input_ in output.parents:
        return "lies inside"
    if output in input_.parents:
        return "holds"
    return None


def check_apart(output: str | Path, inputs: dict, flag: str) -> None:
    """Refuse an output (`flag` names it) that is, holds or lies inside one of `inputs` (flag -> path;
    None or "" skipped): a writer would replace or delete what it reads, or write into a model or data
    folder that is not its own. Every writer calls this before any work."""
    for in_flag, path in inputs.items():
        if not path:
            continue
        relation = _relation(Path(output), Path(path))
        if relation is not None:
            raise UserError(f"{flag} {output}: {relation} {in_flag} {path}, which this command reads; what dflash "
                            f"writes stays apart from what it reads: choose another {flag}")


def written_by(folder: Path) -> str | None:
    """The dflash command that marked `folder` as its output (`WRITER_MARK`), or None."""
    try:
        return json.loads((Path(folder) / WRITER_MARK).read_text()).get("writer")
    except (OSError, ValueError, AttributeError):
        return None


def mark_folder(folder: Path, writer: str) -> None:
    """Mark `folder` as `writer`'s output: what it deletes later (`--overwrite`) is only ever there."""
    if written_by(folder) != writer:
        write_json(Path(folder) / WRITER_MARK, {"writer": writer})


def _bookkeeping(name: str) -> bool:
    """dflash's own files in any output folder: the mark, a lock, a probe (`.dflash*`), a temporary
    `.NAME.partial-*`."""
    return name.startswith(".dflash") or name.endswith(".lock") or ".partial-" in name


def folder_entries(folder: Path, owned) -> tuple[list[Path], list[Path]]:
    """(the entries of `folder` its writer writes, the others), each sorted by name; `owned(name)`
    says which names the writer writes. dflash's bookkeeping files are in neither."""
    if not Path(folder).is_dir():
        return [], []
    entries = sorted((p for p in Path(folder).iterdir() if not _bookkeeping(p.name)), key=lambda p: p.name)
    return [p for p in entries if owned(p.name)], [p for p in entries if not owned(p.name)]


def _names(paths) -> str:
    paths = list(paths)
    return ", ".join(p.name for p in paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")


def check_own_folder(folder: Path, *, writer: str, owned, flag: str) -> list[Path]:
    """The entries of `writer` already in `folder` (a previous output), once `folder` is known to hold
    none that another wrote under those names: a folder not marked by `writer` that holds them
    (the user's own `config.json`, a model's) is refused naming them, whatever the options."""
    ours, _ = folder_entries(folder, owned)
    if ours and written_by(folder) != writer:
        raise UserError(f"{flag} {folder}: holds {_names(ours)}, which {writer} did not write (the folder has no "
                        f"{WRITER_MARK} of it); dflash replaces and deletes only what it wrote: move them away, "
                        f"or choose another {flag}")
    return ours


def delete_own(folder: Path, ours: list[Path], owned, flag: str) -> None:
    """`--overwrite`: delete `ours` (from `check_own_folder`), but only in a folder that holds nothing
    else: anything another wrote there is named and nothing is deleted."""
    _, others = folder_entries(folder, owned)
    if others:
        raise UserError(f"{flag} {folder}: --overwrite deletes only what dflash wrote, and the folder also holds "
                        f"{_names(others)}: move those away (or choose another {flag}); nothing was deleted")
    for p in ours:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
