"""Errors across ranks: every rank exits with one clear line, not a traceback of a dead peer.

Work that rank 0 does for all (preparing the data, claiming the run folder, exporting) runs in
`on_rank0`: its outcome is broadcast, so when it fails every rank stops at once with a line that
points at rank 0's error, instead of waiting in a barrier until gloo reports the closed
connection. `peer_failures_are_one_line` covers the rest: a rank whose peer died mid-collective.
"""
from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import torch.distributed as dist

from dflash.errors import UserError, exit_with_error, say_error


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
    """Decorate a CLI `main`: on every rank, rank 0 included, a collective broken by a dead peer
    (in a step, a barrier, a checkpoint save, an evaluation) becomes one `error:` line and exit
    status 2 (the peer printed the cause, or was killed); a rank stopped by a signal says so
    (`stopped`), also when the signal arrives while it reports a peer's failure."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            try:
                return main(*args, **kwargs)
            except Exception as err:
                if not (dist.is_initialized() and _peer_failure(err)):
                    raise
                exit_with_error(f"error: rank {dist.get_rank()}: stopped because another rank failed "
                                "(its error is above)")
        except KeyboardInterrupt as stop:
            stopped(stop)

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


# ---- signals: a stopped launcher stops every rank ---------------------------------------------
class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM reached this rank (directly, or because its launcher is gone). A
    KeyboardInterrupt, so that data-loader workers stop quietly and no `except Exception` keeps it."""

    def __init__(self, signum: int, why: str = ""):
        super().__init__(signum)
        self.signal, self.why = signal.Signals(signum).name, why


_stopping = {"signal": None, "at": 0.0, "why": "", "resume_hint": None}


def _on_signal(signum, frame):
    if _stopping["signal"] is not None:
        # The launcher follows Ctrl-C with SIGTERM: one stop, one message. The same signal again
        # seconds later is a user whose rank hangs while stopping: exit now.
        if signum == _stopping["signal"] and time.monotonic() - _stopping["at"] > 3:
            os._exit(128 + signum)
        return
    _stopping["signal"], _stopping["at"] = signum, time.monotonic()
    raise Stopped(signum, _stopping["why"] if signum == signal.SIGTERM else "")


def _process(pid: int) -> tuple[str, list[str]] | None:
    """(start time, command line) of a live process (None: gone, or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return None if fields[0] in ("Z", "X") else (fields[19], cmdline)


def _launchers() -> list[tuple[int, str]]:
    """(pid, start time) of the processes whose end must end this rank, when DeepSpeed started it:
    its parent (the per-node launch.py) and the `deepspeed` command above that, which forwards no
    signal to it. Nothing otherwise: a rank of `nohup python launch/train.py` outlives its shell."""
    pid = os.getppid()
    parent = _process(pid)
    if parent is None or "deepspeed.launcher.launch" not in parent[1]:
        return []
    watched = [(pid, parent[0])]
    grand_pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    grand = _process(grand_pid)
    if grand is not None and any(Path(a).name == "deepspeed" or a == "deepspeed.launcher.runner" for a in grand[1]):
        watched.append((grand_pid, grand[0]))
    return watched


def live_children(pid: int) -> int:
    """How many processes whose parent is `pid` are alive (not zombies)."""
    count = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        count += fields[0] not in ("Z", "X") and int(fields[1]) == pid
    return count


def _peer_gone_first() -> bool:
    """Whether DeepSpeed's launcher SIGTERMs local rank 0 because another of its ranks died: it
    terminates its ranks in local-rank order once one exits non-zero (and reaps it), so a rank 0
    that finds fewer siblings than LOCAL_SIZE - 1 was stopped for a peer's failure, not by a user."""
    watched = _launchers()
    if os.environ.get("LOCAL_RANK") != "0" or not watched or not os.environ.get("LOCAL_SIZE", "").isdigit():
        return False
    return live_children(watched[0][0]) < int(os.environ["LOCAL_SIZE"])  # this rank counted


def launcher_gone(watched) -> bool:
    return any((_process(pid) or (None,))[0] != start for pid, start in watched)


def stopped(stop: KeyboardInterrupt):
    """Exit with one line for a rank stopped by a signal; rank 0 says how to continue the run."""
    resume_hint = _stopping["resume_hint"]
    name = stop.signal if isinstance(stop, Stopped) else "SIGINT"
    # the launcher's SIGTERM (not the one our watcher sends, which says why) outran the broken collective
    if name == "SIGTERM" and not (isinstance(stop, Stopped) and stop.why) and _peer_gone_first():
        exit_with_error(f"error: rank {os.environ.get('RANK', '0')}: stopped because another rank failed (its error "
                        "is above; the launcher stopped this rank)")
    why = f" ({stop.why})" if isinstance(stop, Stopped) and stop.why else ""
    rank = int(os.environ.get("RANK", "0"))
    line = f"error: rank {rank}: stopped by {name}{why}"
    if rank == 0 and resume_hint is not None:
        line = f"error: stopped by {name}{why}; {resume_hint()}"
    exit_with_error(line, status=128 + signal.Signals[name].value)


def stop_with_the_launcher(resume_hint=None, poll_seconds: float = 1.0, grace_seconds: float = 60.0) -> None:
    """SIGINT and SIGTERM raise `Stopped` in this rank (one message, however many arrive; on rank 0
    it ends with `resume_hint()`, how to continue the run), and the
    rank stops itself when its launcher ends: at once when its parent dies (PR_SET_PDEATHSIG),
    within `poll_seconds` when the `deepspeed` command above it is stopped or killed (it forwards
    no SIGTERM). A rank that does not stop within `grace_seconds` of that exits anyway."""
    import threading

    _stopping["resume_hint"] = resume_hint
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    if not Path("/proc/self/stat").exists():
        return  # not Linux: the signals above still work
    watched = _launchers()
    if not watched:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if launcher_gone(watched):  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)

    def watch():
        while not launcher_gone(watched):
            time.sleep(poll_seconds)
        _stopping["why"] = "its launcher was stopped"  # for the SIGTERM it sends itself
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_seconds)
        say_error(f"error: rank {os.environ.get('RANK', '?')}: its launcher was stopped and it did not stop within "
                  f"{grace_seconds:.0f}s; exiting")
        os._exit(143)

    threading.Thread(target=watch, name="dflash-launcher-watch", daemon=True).start()
