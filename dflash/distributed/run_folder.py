"""A run folder belongs to one run at a time, and dflash deletes in it only what it wrote.

Rank 0 holds an exclusive lock on `<output_dir>/.dflash.lock` (`dflash.partial.OutputLock`, the
lock of every writer) for the life of the run, so a second run into the same folder stops at
once instead of overwriting the first one's files. The first run in a folder marks it as a run
folder (`dflash.partial.WRITER_MARK`; a run of an older dflash, unmarked, is known by its
checkpoints' `COMPLETE`). A fresh run into a folder that holds a previous run is
refused unless told: `--resume` continues it, `--overwrite` first deletes what a run writes (the
entries below) and nothing else, and only in a marked folder that holds nothing else. A folder
whose files have a run's names but no mark (the user's own `config.json`, a model's) is refused
whatever the options. The on-the-fly token store `data/` is kept: it carries fingerprints and is
rebuilt if they differ.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash.errors import UserError, os_reason
from dflash.partial import OutputLock, check_apart, check_own_folder, delete_own, mark_folder

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
                    for name in ("config", "metrics", "curves", "checkpoints", "tensorboard", "drafter", "eval_turns",
                                 "speculate"))
RUN_PATTERNS = (SAMPLES.format("*"),)
WRITER = "launch/train.py"  # the run folder's mark


def run_entry(name: str) -> bool:
    """Whether a run writes an entry of this name in its folder (its token store `data/` included)."""
    from fnmatch import fnmatch

    return name in RUN_ENTRIES or name == RunPaths(Path()).store.name or any(fnmatch(name, p) for p in RUN_PATTERNS)


def run_entries(output_dir: Path) -> list[Path]:
    """The files and folders of a previous run in `output_dir` (what --overwrite deletes: the store is kept)."""
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


class RunFolder:
    """The lock on a run folder (rank 0 only), released when the process ends."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir)
        self._lock = OutputLock(self.path, flag="--output-dir", what="run", inside=True)

    def lock(self) -> None:
        make_run_folder(self.path)
        self._lock.__enter__()  # held: the lock lasts as long as the process, or until `release`

    def release(self) -> None:
        self._lock.__exit__()

    def claim(self, *, resume: bool, overwrite: bool, reads: dict | None = None) -> None:
        """Lock the folder and refuse a fresh run over a previous one unless told; with `overwrite`,
        delete the previous run's entries first (and only those, in a folder marked as a run's that
        holds nothing else). The folder is never what the run reads, nor in it or holding it (`reads`:
        flag -> path, e.g. --init-drafter RUN/drafter). A `drafter/` folder that is not an export is
        refused first: no option makes it the run's to replace."""
        check_apart(self.path, reads or {}, "--output-dir")  # before the lock makes the folder
        self.lock()
        try:
            self._check(resume=resume, overwrite=overwrite)
            mark_folder(self.path, WRITER)
        except BaseException:
            self.release()
            raise

    def _check(self, *, resume: bool, overwrite: bool) -> None:
        if any(RunPaths(self.path).checkpoints.glob("step-*/COMPLETE")):  # an older dflash's run: no mark, but
            mark_folder(self.path, WRITER)  # checkpoints that only dflash completes
        check_own_folder(self.path, writer=WRITER, owned=run_entry, flag="--output-dir")
        foreign_drafter(self.path)
        previous = run_entries(self.path)
        if not previous or resume:
            return
        if not overwrite:
            raise UserError(f"--output-dir {self.path}: holds a previous run ({', '.join(p.name for p in previous)}); "
                            "continue it with --resume, start over with --overwrite (deletes these and nothing "
                            "else), or choose another folder")
        delete_own(self.path, previous, run_entry, "--output-dir")
