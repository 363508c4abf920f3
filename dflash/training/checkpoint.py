"""Checkpoints: DeepSpeed's engine state plus the run state, written so that a partial one is
never taken for complete.

Layout: `<output_dir>/checkpoints/step-00000042/` holds what `engine.save_checkpoint` writes
and, last, `COMPLETE`: the run state as JSON, written atomically by rank 0 after every rank
finished its files. A folder without it is ignored, so a crash at any point of a save leaves
the previous checkpoint as the newest. `COMPLETE` also lists every file of the checkpoint with
its size, so that a file lost or cut short later is named before DeepSpeed tries to read it.
`--resume` loads the newest complete folder; if it cannot be read, the previous one, with a
warning. Only the newest `keep` complete checkpoints are kept.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.distributed.run_folder import RunPaths
from dflash.errors import UserError, disk_full, free_space
from dflash.identity import same_target

COMPLETE = "COMPLETE"


def _tag(step: int) -> str:
    return f"step-{step:08d}"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)  # the rename itself must reach the disk
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Marker first: a folder half-deleted by a crash must not look complete."""
    (path / COMPLETE).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def _manifest(path: Path) -> dict:
    """Every file under a checkpoint folder with its size in bytes."""
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}


def _damage(path: Path, manifest: dict) -> str | None:
    """What is missing or cut short in `path` compared with the files its save wrote."""
    for name, size in manifest.items():
        f = path / name
        if not f.is_file():
            return f"missing file {f}"
        if f.stat().st_size != size:
            return f"file {f} has {f.stat().st_size} bytes, {size} were written"
    return None


def _load(engine, root: Path, tag: str, module_only: bool):
    """`engine.load_checkpoint` of `root/tag`; `module_only`: the weights alone."""
    if not module_only:
        return engine.load_checkpoint(str(root), tag=tag, load_module_strict=True)[0]
    # Under ZeRO-3 DeepSpeed rebuilds the weights alone from the shards of `root/latest`, whatever the
    # tag. dflash writes no `latest` (it could name a partial save), so DeepSpeed gets a private
    # folder in which `latest` names this checkpoint.
    with tempfile.TemporaryDirectory(prefix="dflash-load-") as view:
        os.symlink(os.path.abspath(root / tag), os.path.join(view, tag))
        Path(view, "latest").write_text(tag)
        return engine.load_checkpoint(view, tag=tag, load_module_strict=True, load_module_only=True,
                                      load_optimizer_states=False, load_lr_scheduler_states=False)[0]


class Checkpointer:
    """A run's checkpoints: saving (all or nothing), and everything a resume decides: which
    checkpoint continues the run, and the refusals of one that would train another drafter or
    continue with other settings."""

    def __init__(self, output_dir: str | Path, keep: int):
        self.root = RunPaths(Path(output_dir)).checkpoints
        self.keep = keep
        self.recorded = None  # (checkpoint, its drafter settings) of the resume, on rank 0 (`claim`)
        self.recorded_options: dict = {}  # the options the checkpoint recorded (its config), on rank 0

    def claim(self, run_folder, *, resume: bool, overwrite: bool, reads: dict, settings: dict, settings_of) -> None:
        """Rank 0: lock the run folder (`RunFolder.claim`) and, for `resume`, refuse a newest checkpoint
        whose drafter settings differ from `settings`, before anything loads. `settings_of(options)`:
        the settings of a checkpoint of an older dflash, which recorded its options alone."""
        run_folder.claim(resume=resume, overwrite=overwrite, reads=reads)
        state = self.newest_state() if resume else None
        if state is None:
            return
        # a setting the checkpoint's record lacks (an older dflash) is the one its recorded options give
        options = state.get("config", {})
        self.recorded = (state["checkpoint"], {**settings_of(options), **(state.get("drafter") or {})})
        self.recorded_options = options
        self.refuse_another_drafter(settings, run_folder)

    def refuse_another_drafter(self, settings: dict, run_folder) -> None:
        """Rank 0: refuse a resume whose checkpoint trained a drafter of other settings than `settings`
        (those known from the options when the folder is claimed, then the ids the target gives)."""
        if self.recorded is None:
            return
        checkpoint, recorded = self.recorded
        diffs = drafter_differences(recorded, settings)
        if diffs:
            run_folder.release()
            raise UserError(f"--resume: {checkpoint} trained a drafter with other settings (checkpoint -> "
                            "now):\n  " + "\n  ".join(diffs) + "\nthey shape its weights or what it learns: resume "
                            "with the checkpoint's values (a run started with --init-drafter resumes with it), or "
                            "train these in a new run (another --output-dir, or --overwrite)")

    def resume(self, engine, *, differences, world_size: int, force: bool) -> tuple[dict, list[str]] | None:
        """Collective: load the newest complete checkpoint that loads into `engine`; returns its run
        state and what changed (None: no checkpoint). `differences(state)` lists the settings that
        changed since (it may load the state it compares, e.g. the planner's); any is refused unless
        `force`. With another world size only the weights load: DeepSpeed cannot re-partition ZeRO
        optimizer state."""
        def check(state):
            diffs = differences(state)
            if diffs and not force:
                raise UserError(f"--resume: {state['checkpoint']} was made with other "
                                "data or settings:\n  " + "\n  ".join(diffs)
                                + "\nresume with the same settings, or add --force-resume to continue anyway "
                                "(the rest of the epoch is replanned)")
            return diffs

        state = self.load_latest(engine, check, module_only=lambda state: state["world_size"] != world_size)
        return None if state is None else (state, check(state))

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and (p / COMPLETE).is_file())

    def resume_hint(self) -> str:
        """How to continue a run stopped now: from the newest complete checkpoint, if there is one."""
        saved = self.complete()
        if saved:
            return f"the newest complete checkpoint is {saved[-1]}: continue from it with the same command and --resume"
        return "no checkpoint was written yet: the same command with --resume starts the run again"

    def newest_state(self) -> dict | None:
        """The run state of the newest complete checkpoint whose COMPLETE can be read (None: none),
        without loading anything: what a resume will continue, to compare settings with."""
        for path in reversed(self.complete()):
            try:
                state = json.loads((path / COMPLETE).read_text())
            except (OSError, ValueError):
                continue
            return {**state, "checkpoint": str(path)}
        return None

    def save(self, engine, run_state: dict) -> Path:
        """Collective: every rank calls it. `run_state` (its "step" among it) must be JSON-serialisable."""
        step = run_state["step"]
        path = self.root / _tag(step)
        if dist.get_rank() == 0 and path.exists():  # e.g. a step redone after a fallback: never mix two saves
            _remove(path)
        dist.barrier()
        try:
            engine.save_checkpoint(str(self.root), tag=_tag(step), save_latest=False)
            dist.barrier()
            if dist.get_rank() == 0:
                files = _manifest(path)
                _write_atomically(path / COMPLETE, json.dumps({**run_state, "files": files}) + "\n")
                for old in self.complete()[: -self.keep]:
                    _remove(old)
        except (OSError, RuntimeError) as err:
            if not disk_full(err):
                raise
            _remove(path)  # a partial save: never loaded, and its space is needed
            previous = self.complete()
            raise UserError(f"checkpoint {path}: the disk is full ({free_space(self.root)}); the save was removed"
                            + (f" and {previous[-1].name} is the newest complete checkpoint" if previous else "")
                            + ". Free some space (or lower --keep-checkpoints) and continue with --resume") from None
        dist.barrier()
        return path

    def load_latest(self, engine, check, module_only=lambda state: False) -> dict | None:
        """Collective: load the newest readable complete checkpoint and return its run state.

        `check(state)` sees the run state first and may refuse it (raise); `module_only(state)`
        says to load the weights alone (optimizer state that cannot be re-partitioned).
        Returns None when there is no complete checkpoint at all.
        """
        candidates = self.complete()
        if not candidates:
            return None
        failures = []
        for path in reversed(candidates):
            try:
                state = json.loads((path / COMPLETE).read_text())
            except (OSError, ValueError) as err:
                state, reason = None, f"unreadable {COMPLETE}: {err}"
            if state is not None and "planner" not in state:
                state, reason = None, f"no run state in {COMPLETE} (written by an older dflash)"
            if state is not None:
                state["checkpoint"] = str(path)
                check(state)
                only = module_only(state)
                reason = _damage(path, state.pop("files", {}))
            if state is not None and reason is None:
                try:
                    loaded = _load(engine, self.root, path.name, only)
                    reason = None if loaded is not None else "DeepSpeed found nothing to load"
                except Exception as err:  # noqa: BLE001 - any unreadable file means: fall back
                    reason = f"{type(err).__name__}: {err or 'no message'}"
            # every rank must end on the same checkpoint, even if only one rank's files are bad
            ok = torch.tensor([0 if state is None or reason else 1], device=engine.device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if ok.item():
                return state
            failures.append(f"{path.name}: {reason or 'another rank could not load its part'}")
            if path != candidates[0]:
                warnings.warn(f"checkpoint {path} cannot be loaded ({failures[-1]}); falling back to the previous one",
                              stacklevel=2)
        raise UserError(f"--resume: none of the {len(candidates)} complete checkpoints in {self.root} "
                        "can be loaded:\n  "
                        + "\n  ".join(failures)
                        + "\nthe checkpoints are kept as they are: resume with the options the run recorded in its "
                        "config.json, or train anew in another --output-dir")


def drafter_differences(before: dict, now: dict) -> list[str]:
    """`option: checkpoint value -> value now` for every setting of `drafter_settings` that differs
    (a target by its content, `dflash.identity.same_target`, shown by its path)."""
    def show(value):
        return ",".join(map(str, value)) if isinstance(value, list) else str(value)

    diffs = []
    for flag, new in now.items():
        old = before.get(flag)
        if old is None:
            continue
        if flag == "--target":
            if not same_target(old, new):
                diffs.append(f"--target: {old['path']} -> {new['path']}" if old["path"] != new["path"]
                             else f"--target: {new['path']} is another model now (its config or weights changed)")
        elif old != new:
            diffs.append(f"{flag}: {show(old)} -> {show(new)}")
    return diffs
