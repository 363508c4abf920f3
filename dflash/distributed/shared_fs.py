"""Multi-node runs: stop at once, with a clear message, when a node does not see what it must.

Every rank reads the inputs (target, data, DeepSpeed config) and the run folder: rank 0
prepares JSONL data there, every rank writes its checkpoint shards there, rank 0 writes the
`COMPLETE` markers that all ranks read on `--resume`. Without a shared filesystem a node would
otherwise fail alone (and leave the others waiting in a collective until the timeout) or, worse,
train on a different copy of the data. `check_shared_paths` is one collective call, made before
any heavy work, after which every rank either goes on or raises the same UserError.
"""
from __future__ import annotations

import hashlib
import socket
import time
import uuid
from pathlib import Path

import torch.distributed as dist

from dflash.distributed.run_folder import make_run_folder
from dflash.errors import UserError, os_reason

PROBE = ".dflash-shared-check"


def _looks(path: Path) -> str | None:
    """What a rank sees at `path`, cheap to compute and equal for identical copies: None when
    nothing is there, the size of a file, the names and sizes of a folder's files."""
    try:
        if path.is_file():
            return f"a file of {path.stat().st_size:,} bytes"
        if path.is_dir():
            files = sorted((p.name, p.stat().st_size) for p in path.iterdir() if p.is_file())
            digest = hashlib.sha256(repr(files).encode()).hexdigest()[:12]
            return f"a folder of {len(files)} files, {sum(s for _, s in files):,} bytes (names and sizes {digest})"
    except OSError as err:
        return f"unreadable ({err})"
    return None


def _sees(probe: Path, token: str, tries: int = 10) -> bool:
    """Whether `probe` holds `token`, given a few seconds: a network filesystem may show a new file
    to other nodes only after its attribute cache expires."""
    for attempt in range(tries):
        try:
            if probe.read_text() == token:
                return True
        except OSError:
            pass
        if attempt + 1 < tries:
            time.sleep(0.5)
    return False


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'."""
    spans, start = [], ranks[0]
    for prev, cur in zip(ranks, [*ranks[1:], None], strict=True):
        if cur != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def _where(views: list[tuple[str, object]], pick) -> str:
    """'ranks 8-15 on node1, rank 20 on node3' for the ranks whose view `pick` selects."""
    by_host: dict[str, list[int]] = {}
    for rank, (host, view) in enumerate(views):
        if pick(view):
            by_host.setdefault(host, []).append(rank)
    return "; ".join(f"{_ranks(r)} on {host}" for host, r in by_host.items())


def check_shared_paths(output_dir: Path, inputs: dict[str, Path]) -> None:
    """Collective: raise the same UserError on every rank unless every rank sees rank 0's run
    folder and, at the same paths, the same `inputs` ({flag: path}) as rank 0.

    An input that no rank sees is left to the usual "no such file" checks.
    """
    world_size = dist.get_world_size()
    if world_size == 1:
        return
    rank = dist.get_rank()
    token, written = None, None
    if rank == 0:
        try:
            make_run_folder(output_dir)
            token = uuid.uuid4().hex
            (output_dir / PROBE).write_text(token)
        except UserError as err:
            token, written = None, str(err)
        except OSError as err:
            token, written = None, f"--output-dir {output_dir}: cannot write in the folder ({os_reason(err)})"
    sent = [token, written]
    dist.broadcast_object_list(sent, src=0)  # after rank 0 wrote the probe
    token, written = sent
    if written is not None:  # the folder itself, on every node: not a multi-node problem
        raise UserError(written)
    view = {flag: _looks(path) for flag, path in inputs.items()}
    view["run"] = token is not None and _sees(output_dir / PROBE, token)
    views: list = [None] * world_size
    dist.all_gather_object(views, (socket.gethostname(), view))
    if rank == 0 and token is not None:
        (output_dir / PROBE).unlink(missing_ok=True)

    problems = []
    if not all(v["run"] for _, v in views):
        problems.append(
            f"--output-dir {output_dir}: the file rank 0 ({views[0][0]}) wrote there ({PROBE}) is not seen by "
            f"{_where(views, lambda v: not v['run'])}. The run folder must be one folder, at the same path, on a "
            "filesystem that every node shares: rank 0 prepares JSONL data into it, every rank writes its "
            "checkpoint files into it and reads the COMPLETE markers that rank 0 writes")
    inputs_differ = False
    for flag, path in inputs.items():
        seen = [v[flag] for _, v in views]
        if all(s is None for s in seen) or all(s == seen[0] for s in seen):
            continue  # nowhere (the usual "no such file" error follows) or the same everywhere
        inputs_differ = True
        if any(s is None for s in seen):
            problems.append(f"{flag} {path}: not found by {_where(views, lambda v, f=flag: v[f] is None)}; found by "
                            f"{_where(views, lambda v, f=flag: v[f] is not None)}")
        else:
            problems.append(f"{flag} {path}: rank 0 ({views[0][0]}) sees {seen[0]}; "
                            f"{_where(views, lambda v, f=flag, s0=seen[0]: v[f] != s0)}: different contents")
    if inputs_differ:
        problems.append(f"every node reads {', '.join(inputs)} at the same path: put them on a shared filesystem, "
                        "or the same copy on each node")
    if problems:
        raise UserError("multi-node setup: not every rank sees the same files\n  " + "\n  ".join(problems)
                        + "\nsee 'Multi-node training' in docs/GUIDE.md")
