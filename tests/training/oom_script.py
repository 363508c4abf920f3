"""`launch/train.py` whose drafter runs out of memory in every training forward of one step.

  python tests/training/oom_script.py STEP [train.py options]

The failure is what the CPU's allocator raises (a plain RuntimeError, not torch.OutOfMemoryError:
taken from an allocation that really fails), injected where memory does not run out; CUDA's
torch.OutOfMemoryError is `test_an_allocation_failure_is_known_on_every_device`'s.
"""
import os
import runpy
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from dflash.drafter.network import DFlashDrafter  # noqa: E402
from dflash.training import trainer  # noqa: E402

at, argv = int(sys.argv[1]), sys.argv[2:]
now = {"step": 0}
train_step, forward = trainer.Trainer.train_step, DFlashDrafter.forward


def counted(self):
    now["step"] = self.step + 1
    return train_step(self)


def cpu_allocation_failure() -> RuntimeError:
    try:
        torch.empty(1 << 62, dtype=torch.uint8)
    except RuntimeError as err:
        return err
    raise AssertionError("an allocation of 4 EiB succeeded")


def forward_or_oom(self, *args, **kwargs):
    if torch.is_grad_enabled() and now["step"] == at:
        raise cpu_allocation_failure()
    return forward(self, *args, **kwargs)


trainer.Trainer.train_step, DFlashDrafter.forward = counted, forward_or_oom
sys.argv = ["train.py", *argv]
runpy.run_path(str(Path(__file__).resolve().parents[2] / "launch" / "train.py"), run_name="__main__")
