"""`launch/train.py` with faults injected at exact points, for the reliability tests.

  deepspeed --num_gpus 2 tests/training/fault_script.py FAULT [train.py options]

FAULT is `kind@step:rank` (rank: a number or `all`), one of
  kill-mid-step        SIGKILL after the first backward of that step, before the optimizer step
  kill-mid-save        SIGKILL in the checkpoint save of that step, after the rank's first file
  kill-before-marker   SIGKILL once every rank wrote its files, before COMPLETE is written
  wait                 at the start of that step, write `waiting` into the run folder and sleep (to be signalled)
or `nan@FIRST-LAST`: the loss of every micro-batch of those steps is NaN (all ranks).
"""
import os
import runpy
import signal
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
    TorchCheckpointEngine,
)

from dflash.objective.loss import BlockLoss
from dflash.training import checkpoint, trainer

# the launcher puts --local_rank=N first; train.py takes it too
args = sys.argv[1:]
fault = next(a for a in args if not a.startswith("--local_rank"))
argv = [a for a in args if a is not fault]
kind, where = fault.split("@")
rank = int(os.environ["RANK"])
now = {"step": 0, "saving": None}  # the step being trained, and the step being saved


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def hits(step):
    target, _, who = where.partition(":")
    return step == int(target) and who in ("all", str(rank))


def wrap(owner, name, before=None, after=None):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if before:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after:
            after(*args, **kwargs)
        return result

    setattr(owner, name, wrapper)


def entering_step(self, *args, **kwargs):
    now["step"] = self.step + 1


def entering_save(self, *args, **kwargs):
    now["saving"] = self.step


wrap(trainer.Trainer, "train_step", before=entering_step)
wrap(trainer.Trainer, "save_checkpoint", before=entering_save)

if kind == "kill-mid-step":
    wrap(deepspeed.DeepSpeedEngine, "backward", after=lambda *a, **k: hits(now["step"]) and die())
elif kind == "kill-mid-save":
    wrap(TorchCheckpointEngine, "save", after=lambda *a, **k: hits(now["saving"]) and die())
elif kind == "kill-before-marker":
    wrap(checkpoint, "_write_atomically", before=lambda *a, **k: hits(now["saving"]) and die())
elif kind == "wait":
    def wait(self, *args, **kwargs):
        if hits(self.step + 1):
            Path(argv[argv.index("--output-dir") + 1], "waiting").write_text(str(self.step + 1))
            time.sleep(300)

    wrap(trainer.Trainer, "train_step", before=wait)
elif kind == "nan":
    first, last = map(int, where.split("-"))
    score = BlockLoss.__call__

    def poisoned(self, *args, **kwargs):
        out = score(self, *args, **kwargs)
        if torch.is_grad_enabled() and first <= now["step"] <= last:
            out.loss_sum = out.loss_sum * float("nan")
        return out

    BlockLoss.__call__ = poisoned
else:
    raise SystemExit(f"unknown fault {fault!r}")

sys.argv = ["train.py", *argv]
runpy.run_path(str(Path(__file__).resolve().parents[2] / "launch" / "train.py"), run_name="__main__")
