"""User-facing errors: the command-line entry points print them without a traceback."""
from __future__ import annotations

import functools
import gc
import os
import signal
import sys
import threading


class UserError(Exception):
    """Bad input or configuration: the message says what is wrong, where, and how to fix it."""


class NonFiniteWeights(UserError):
    """Weights that hold NaN or inf (a diverged training); callers may add what to do next."""


class DiskFull(UserError):
    """A write that failed for want of space and left nothing behind; callers may add what to do next."""


def say_error(line: str) -> None:
    """One write of the whole line: ranks started with `python -u` share stderr, and print()'s
    separate write of the newline lets another rank's line land in between."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def exit_with_error(line: str, status: int = 2):
    """Print `line` and exit with `status`, the process group taken down first (`end_process_group`).
    A SIGINT or SIGTERM from then on (the launcher sends one to every rank once one failed) exits at
    once with `status`: raised, it would land in whatever cleanup runs then (a weakref callback, a
    progress bar's `__del__`), which prints it as an ignored exception's traceback."""
    say_error(line)
    if threading.current_thread() is threading.main_thread():
        def exit_now(signum, frame):
            try:
                sys.stdout.flush()
            except Exception:  # noqa: BLE001 - a write it interrupted: exiting anyway
                pass
            os._exit(status)  # the line is out; nothing is left to save

        signal.signal(signal.SIGINT, exit_now)
        signal.signal(signal.SIGTERM, exit_now)
    end_process_group()
    sys.exit(status)


def end_process_group(finished: bool = False) -> None:
    """Take down this process's process groups, if it has any, and join their gloo threads.

    A gloo worker drops a finished collective's work, and the last reference to its tensors
    (which takes the GIL), a moment after the caller's wait returned. If that moment falls after
    interpreter shutdown began, Python ends the thread with pthread_exit, whose unwinding through
    C++ destructors calls std::terminate ("terminate called without an active exception": SIGABRT,
    status 250 or -6 instead of the intended one). `destroy_process_group` only unregisters the
    groups; a gloo group joins its threads when its last reference goes. So the references the
    caller does not hold go here: DeepSpeed's module-level ones (its clone of the world group, and,
    through its forward-module stack and the ZeRO-3 release cache of every coordinator, the
    partitioned parameters, each holding the world group) are dropped and the cycles collected.
    When the run `finished`, every DeepSpeed engine left is destroyed first (its optimizer's hooks
    keep it alive otherwise); not after a failure, where its device synchronize could wait for a
    collective that a dead peer never joins.
    `torch.distributed.nn` holds the world group in its defaults unless imported before it exists
    (`dflash.distributed.process_group.init_distributed`).
    """
    dist = sys.modules.get("torch.distributed")  # loaded only if this process uses it
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if finished and "deepspeed" in sys.modules:
        _destroy_deepspeed_engines()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    if "deepspeed" in sys.modules:
        _drop_deepspeed_references(dist.ProcessGroup)
    gc.collect()


def _destroy_deepspeed_engines() -> None:
    """`destroy()` every DeepSpeed engine left: it removes its optimizer's gradient hooks, which
    the autograd graph (C++, out of the collector's reach) holds, and through them the engine."""
    from deepspeed import DeepSpeedEngine

    # type(), not isinstance: that reads `__class__`, and torch's deprecated aliases warn on it
    for engine in [o for o in gc.get_objects() if issubclass(type(o), DeepSpeedEngine)]:
        try:
            engine.destroy()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def _drop_deepspeed_references(group_type) -> None:
    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator
    from deepspeed.utils import groups

    for name, value in vars(groups).items():
        if isinstance(value, group_type):
            setattr(groups, name, None)
        elif isinstance(value, dict) and any(isinstance(v, group_type) for v in value.values()):
            value.clear()
    parameter_offload.FWD_MODULE_STACK.clear()
    release = vars(partitioned_param_coordinator.PartitionedParameterCoordinator)[
        "_PartitionedParameterCoordinator__params_to_release"]
    for cell in release.__closure__ or ():  # the lru_cache inside DeepSpeed's nvtx wrapper
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()


def exit_on_user_error(main):
    """Decorate a CLI `main`: a UserError, or a fault of the environment that no code path named
    more precisely (a full disk, a read-only or missing folder, a path of the wrong kind), becomes
    one `error: ...` line on stderr and exit status 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            result = main(*args, **kwargs)
        except UserError as err:
            line = f"error: {err}"
        except Exception as err:  # noqa: BLE001 - anything else is raised again as it was
            line = environment_error(err)
            if line is None:
                raise
            line = f"error: {line}"
        else:
            end_process_group(finished=True)  # a run that succeeded exits 0, whatever gloo's threads did
            return result
        # out of the except clause: the error's traceback, and the run's objects in its frames, are gone
        exit_with_error(line)

    return wrapper


# errno -> what it means for the user, for faults of the environment (not of dflash)
_ENVIRONMENT = {
    "ENOSPC": "the disk is full", "EDQUOT": "the disk quota is used up", "EROFS": "read-only file system",
    "EACCES": "permission denied", "EPERM": "operation not permitted", "ENOTDIR": "a part of the path is not a folder",
    "EISDIR": "is a folder, not a file", "EEXIST": "already exists", "EIO": "input/output error (a failing disk?)",
    "ENAMETOOLONG": "file name too long", "EMFILE": "too many open files (raise `ulimit -n`)",
}


def os_reason(err: OSError, path=None) -> str:
    """What an OSError means, in words; for a full disk, the free space where `path` (or the
    error's file) lies."""
    import errno

    name = errno.errorcode.get(err.errno or 0, "")
    reason = _ENVIRONMENT.get(name) or err.strerror or str(err)
    if name in ("ENOSPC", "EDQUOT") and (path or err.filename):
        reason += f" ({free_space(path or err.filename)})"
    return reason


def environment_error(err: BaseException) -> str | None:
    """One line for a fault of the environment in `err` or an error it was raised from (None:
    not one): the file it concerns and what happened, and, for a full disk, what to do."""
    import errno

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and errno.errorcode.get(err.errno or 0) in _ENVIRONMENT:
            where = f"{err.filename}: " if err.filename else ""
            advice = "; free some space and run again" if disk_full(err) else ""
            return f"{where}{os_reason(err)}{advice}"
        if not isinstance(err, OSError) and disk_full(err):  # torch.save, safetensors: no errno, no file
            return f"the disk is full while writing a file ({type(err).__name__}: {err}); free some space and run again"
        err = err.__cause__ or err.__context__
    return None


def disk_full(err: BaseException) -> bool:
    """Whether `err`, or an error it was raised from, is a full disk. torch.save reports one as
    a RuntimeError "unexpected pos ..." from its zip writer, safetensors as a SafetensorError, with
    no errno."""
    import errno

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(err, RuntimeError) and "unexpected pos" in str(err):
            return True
        if "No space left on device" in str(err):  # e.g. safetensors' SafetensorError (os error 28)
            return True
        err = err.__cause__ or err.__context__
    return False


# What an allocation that fails raises where torch has no OutOfMemoryError for it: the CPU's
# allocator (a plain RuntimeError), and the accelerators' libraries that report it in words
OUT_OF_MEMORY = ("DefaultCPUAllocator: can't allocate memory", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def allocation_failed(err: BaseException) -> bool:
    """Whether `err` is an allocation that failed, on any device: torch.OutOfMemoryError (CUDA), or a
    RuntimeError saying so (the CPU's allocator, cuBLAS)."""
    import torch

    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and any(text in str(err) for text in OUT_OF_MEMORY))


def free_space(path) -> str:
    """Free space on the file system of `path` (or its nearest existing parent), for messages."""
    import shutil
    from pathlib import Path

    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    free = shutil.disk_usage(path).free
    for unit, power in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if free >= 2**power:
            return f"{free / 2**power:.2f} {unit} free"
    return f"{free} bytes free"
