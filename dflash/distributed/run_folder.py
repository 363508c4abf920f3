"""A run folder belongs to one run at a time, and dflash deletes in it only what it wrote.

Rank 0 holds an exclusive lock on `<output_dir>/.dflash.lock` for the life of the run, so a
second run into the same folder stops at once instead of overwriting the first one's files. A
fresh run into a folder that holds a previous run is refused unless told: `--resume` continues
it, `--overwrite` first deletes what a run writes (the entries below) and nothing else. The
on-the-fly token store `data/` is kept: it carries fingerprints and is rebuilt if they differ.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dflash.errors import UserError, os_reason
from dflash.partial import try_lock

LOCK = ".dflash.lock"
SAMPLES = "samples.rank{}.jsonl"  # --sample-log, one per rank


@dataclass(frozen=True)
class RunPaths:
    """Where a run keeps what it writes, under its folder (`--output-dir`): the one place of their names."""

    root: Path

    config = property(lambda self: self.root / "config.json")  # the run's options (`load_run` reads them)
    metrics = property(lambda self: self.root / "metrics.jsonl")
    curves = property(lambda self: self.root / "curves.png")
    checkpoints = property(lambda self: self.root / "checkpoints")
    tensorboard = property(lambda self: self.root / "tensorboard")
    drafter = property(lambda self: self.root / "drafter")  # the export
    eval_turns = property(lambda self: self.root / "eval_turns.json")  # the held-out turns sampled at each T
    speculate = property(lambda self: self.root / "speculate.json")  # the end-of-run decoding
    store = property(lambda self: self.root / "data")  # the token store prepared from conversations

    def samples(self, rank: int) -> Path:
        return self.root / SAMPLES.format(rank)

    @classmethod
    def of_drafter(cls, drafter_dir: Path) -> RunPaths:
        """The run an exported drafter folder belongs to."""
        return cls(Path(drafter_dir).parent)


# what a run writes in its folder, and so what --overwrite may delete
RUN_ENTRIES = tuple(getattr(RunPaths(Path()), name).name
                    for name in ("config", "metrics", "curves", "checkpoints", "tensorboard", "drafter", "eval_turns"))
RUN_PATTERNS = (SAMPLES.format("*"),)


def run_entries(output_dir: Path) -> list[Path]:
    """The files and folders of a previous run in `output_dir`."""
    found = [output_dir / name for name in RUN_ENTRIES if (output_dir / name).exists()]
    for pattern in RUN_PATTERNS:
        found += sorted(output_dir.glob(pattern))
    return found


def make_run_folder(path: Path) -> None:
    """Create the run folder (and its parents): a path that is a file, or where no folder can be
    made (read-only, no permission, a full disk), is one line naming it."""
    if path.exists() and not path.is_dir():
        raise UserError(f"--output-dir {path}: exists and is not a folder; choose another --output-dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--output-dir {path}: cannot create the folder ({os_reason(err)}); choose another "
                        "--output-dir") from None


def foreign_drafter(output_dir: Path) -> None:
    """Refuse a `drafter/` folder that is not a drafter export: the run exports there at the end,
    and would stop at that point rather than replace what it did not write."""
    from dflash.drafter.network import is_drafter_folder

    drafter = output_dir / "drafter"
    if drafter.exists() and not is_drafter_folder(drafter):
        raise UserError(f"--output-dir {output_dir}: {drafter} is not a drafter exported by dflash, and the run "
                        "exports its drafter there at the end; move or rename that folder, or choose another "
                        "--output-dir")


def _within(path: Path, entry: Path) -> bool:
    """Whether `path` is `entry` or lies inside it (links resolved)."""
    path, entry = path.resolve(), entry.resolve()
    return path == entry or entry in path.parents


class RunFolder:
    """The lock on a run folder (rank 0 only), released when the process ends."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir)
        self._fd = None

    def lock(self) -> None:
        make_run_folder(self.path)
        try:
            fd, holder = try_lock(self.path / LOCK)
        except OSError as err:
            raise UserError(f"--output-dir {self.path}: cannot write in the folder ({os_reason(err)}); choose "
                            "another --output-dir") from None
        if fd is None:
            raise UserError(f"--output-dir {self.path}: another run is using this folder (process {holder}); "
                            "wait for it to end, or choose another --output-dir")
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}@{os.uname().nodename}\n".encode())
        self._fd = fd  # held open: the lock lasts as long as the process

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def claim(self, *, resume: bool, overwrite: bool, reads: dict | None = None) -> None:
        """Lock the folder and refuse a fresh run over a previous one unless told; with
        `overwrite`, delete the previous run's entries first (and only those), but never one that
        holds or lies in what the run reads (`reads`: flag -> path, e.g. --init-drafter RUN/drafter).
        A `drafter/` folder that is not an export is refused first: no option makes it the run's to
        replace."""
        self.lock()
        try:
            foreign_drafter(self.path)
        except UserError:
            self.release()
            raise
        previous = run_entries(self.path)
        if not previous or resume:
            return
        names = ", ".join(p.name for p in previous)
        if not overwrite:
            self.release()
            raise UserError(f"--output-dir {self.path}: holds a previous run ({names}); continue it with --resume, "
                            "start over with --overwrite (deletes these and nothing else), or choose another folder")
        for p in previous:
            for flag, path in (reads or {}).items():
                if _within(Path(path), p):
                    self.release()
                    raise UserError(f"--overwrite would delete {p}, and the run reads {flag} {path} from it: "
                                    f"copy {path} out of --output-dir {self.path} first, or choose another "
                                    "--output-dir")
        for p in previous:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
