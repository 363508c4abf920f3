"""Checkpoints: DeepSpeed's engine state plus the run state, written so that a partial one is
never taken for complete.

Layout: `<output_dir>/checkpoints/step-00000042/` holds what `engine.save_checkpoint` writes
and, last, `COMPLETE` (written by rank 0 after every rank finished). `--resume` loads the
newest folder with `COMPLETE`; if it cannot be read, the previous one, with a warning. Only
the newest `keep` complete checkpoints are kept.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist

COMPLETE = "COMPLETE"


def _tag(step: int) -> str:
    return f"step-{step:08d}"


class Checkpointer:
    def __init__(self, output_dir: str | Path, keep: int):
        self.root = Path(output_dir) / "checkpoints"
        self.keep = keep

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and (p / COMPLETE).is_file())

    def save(self, engine, step: int, client_state: dict) -> Path:
        """Collective: every rank calls it."""
        path = self.root / _tag(step)
        engine.save_checkpoint(str(self.root), tag=_tag(step), client_state=client_state, save_latest=False)
        dist.barrier()
        if dist.get_rank() == 0:
            marker = path / COMPLETE
            with open(marker, "w") as f:
                json.dump({"step": step}, f)
                f.flush()
                os.fsync(f.fileno())
            for old in self.complete()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return path

    def load_latest(self, engine) -> dict | None:
        """Collective: load the newest readable complete checkpoint; returns its client state."""
        candidates = self.complete()
        for path in reversed(candidates):
            try:
                loaded, client_state = engine.load_checkpoint(str(self.root), tag=path.name,
                                                              load_module_strict=True)
            except Exception as err:  # noqa: BLE001 - any unreadable file means: fall back
                loaded, client_state = None, None
                reason = f"{type(err).__name__}: {err}"
            else:
                reason = "DeepSpeed found nothing to load"
            if loaded is not None and client_state:
                return {**client_state, "checkpoint": str(path)}
            warnings.warn(f"checkpoint {path} is unreadable ({reason}); falling back to the previous one")
        return None
