"""Errors across ranks: every rank exits with one clear line, not a traceback of a dead peer.

Work that rank 0 does for all (preparing the data, claiming the run folder, exporting) runs in
`on_rank0`: its outcome is broadcast, so when it fails every rank stops at once with a line that
points at rank 0's error, instead of waiting in a barrier until gloo reports the closed
connection. `peer_failures_are_one_line` covers the rest: a rank whose peer died mid-collective.
"""
from __future__ import annotations

import functools

import torch.distributed as dist

from dflash.errors import UserError, exit_with_error


def on_rank0(fn, what: str):
    """`fn()` on rank 0 while the others wait; returns its result on rank 0 (None elsewhere).
    If it raises, rank 0 re-raises and every other rank raises a UserError naming `what`."""
    rank = dist.get_rank()
    result = failure = None
    if rank == 0:
        try:
            result = fn()
        except BaseException as err:  # noqa: BLE001 - shared with the other ranks, then re-raised
            failure = err
    outcome = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    if outcome[0] is not None:
        raise UserError(f"rank {rank}: stopped because rank 0 failed while {what} (its error is above)")
    return result


def _peer_failure(err: BaseException) -> bool:
    """A collective that failed because another rank went away."""
    text = str(err)
    return isinstance(err, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted"))


def peer_failures_are_one_line(main):
    """Decorate a CLI `main`: on a rank other than 0, a collective broken by a dead peer becomes
    one `error:` line and exit status 2 (the peer printed the cause)."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except Exception as err:
            if not (dist.is_initialized() and dist.get_rank() != 0 and _peer_failure(err)):
                raise
            exit_with_error(f"error: rank {dist.get_rank()}: stopped because another rank failed (its error is above)")

    return wrapper


def free_port() -> int:
    """A TCP port no process on this machine holds now (for a process group's rendezvous)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def single_process_env(environ, num_gpus: int) -> None:
    """Without the launcher (`python launch/train.py`), fill in `environ` the variables of a
    one-rank run on the CPU or the one GPU, which DeepSpeed would otherwise look for through
    MPI; with several GPUs, say to use the launcher."""
    if "RANK" in environ or "LOCAL_RANK" in environ:
        return
    if num_gpus > 1:
        raise UserError(f"{num_gpus} GPUs: start the run with the launcher to use them: "
                        f"deepspeed --num_gpus {num_gpus} launch/train.py ... (or CUDA_VISIBLE_DEVICES=0 for one)")
    environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(free_port())})
