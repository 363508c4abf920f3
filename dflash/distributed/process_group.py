"""This rank's process group, on its own device."""
from __future__ import annotations

import os

from dflash.errors import UserError


def init_distributed() -> None:
    """`deepspeed.init_distributed()` on this rank's device, without DeepSpeed's CPU shared-memory op.

    The device comes first: DeepSpeed selects it only inside `deepspeed.initialize`, after the
    target is loaded and the first collectives ran, so every rank of a node would use GPU 0.
    On CPU ranks DeepSpeed JIT-builds a shared-memory all-reduce that only its inference
    all-reduce calls (training reduces through gloo). Building it costs a minute on a fresh
    machine, maps a 66 MB /dev/shm buffer per rank that is never unlinked, and runs under
    torch's build lock: a rank killed while holding it leaves the lock behind and every later
    run on the machine waits on it forever. DeepSpeed keeps the compatible-ops table as one dict
    so that edits like this one persist.
    """
    # torch.distributed.nn before the world group exists: its functions' `group=group.WORLD`
    # defaults, evaluated at import (DeepSpeed imports it in `initialize`), would keep that group,
    # and its gloo threads, alive through interpreter shutdown (`dflash.errors.end_process_group`).
    import deepspeed
    import torch.distributed.nn  # noqa: F401
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if accelerator.device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    try:
        deepspeed.init_distributed()
    except torch.distributed.DistNetworkError as err:
        if "EADDRINUSE" not in str(err):
            raise
        # rank 0 serves the rendezvous on MASTER_PORT: another job on this machine (a second training)
        # has it; the launcher's default is 29500 for every job
        raise UserError(f"port {os.environ.get('MASTER_PORT', '29500')} on {os.environ.get('MASTER_ADDR', 'localhost')}"
                        " is taken (another run on this machine?): give this one another port, e.g. "
                        "deepspeed --master_port 29501 launch/train.py ...") from None
