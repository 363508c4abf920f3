"""Short measured training trials over DeepSpeed settings, ranked by real tokens/s.

DeepSpeed's autotuner ranks configurations by samples/s over a few steps; with shuffled
variable-length data a sample is no unit of work and a few steps are noise. Each trial here
is a real training run (`dflash.training.cli`, what `launch/train.py` runs) in its own process
(an out-of-memory error ends the trial, not the sweep), measured over many steps after a
warm-up, in real tokens/s from the trainer's own metrics.
"""
from __future__ import annotations

import copy
import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dflash.distributed.ranks import free_port
from dflash.errors import UserError

RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")
EXCEPTION = re.compile(r"^[\w.]+(Error|Exception): ")
OOM = re.compile(r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|Killed", re.IGNORECASE)


@dataclass
class Trial:
    name: str
    ds_config: dict
    token_budget: int
    micro_batches: int  # per optimizer step: step tokens = micro_batches x token budget
    activation_checkpointing: bool = False
    status: str = "pending"  # ok, oom, error
    tokens_per_s: float = 0.0
    step_seconds: float = 0.0
    peak_memory_mib: float = 0.0
    detail: str = ""


def trial_config(base: dict, stage: int, offload: str) -> dict:
    """The base DeepSpeed JSON with another ZeRO stage and offload."""
    config = copy.deepcopy(base)
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = stage
    zero.pop("offload_optimizer", None)
    zero.pop("offload_param", None)
    if stage != 2:
        zero["overlap_comm"] = False  # unmanaged accumulation overlaps communication only under ZeRO-2
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return config


def search_space(base: dict, stages, budgets, micro_batches, offloads, checkpointing=(False,)) -> list[Trial]:
    trials = []
    for stage, budget, k, offload, ac in itertools.product(stages, budgets, micro_batches, offloads, checkpointing):
        name = f"zero{stage}{'-offload' if offload == 'cpu' else ''}-b{budget}-x{k}{'-ac' if ac else ''}"
        trials.append(Trial(name, trial_config(base, stage, offload), budget, k, ac))
    return trials


def run_trial(trial: Trial, train_args: list[str], workdir: Path, *, num_ranks: int, steps: int, warmup: int,
              timeout: float) -> Trial:
    """Run one trial to completion (or failure) and fill in its measurements."""
    folder = workdir / trial.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ds_config.json").write_text(json.dumps(trial.ds_config, indent=2) + "\n")
    metrics = folder / "run" / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    launcher = Path(sys.executable).parent / "deepspeed"
    # the package's trainer, from the caller's folder: relative paths in `train_args` are the caller's
    cmd = [str(launcher), "--num_gpus", str(num_ranks), "--master_port", str(free_port()),
           "--module", "dflash.training.cli", *train_args, "--output-dir", str(folder / "run"),
           "--token-budget", str(trial.token_budget), "--step-tokens", str(trial.micro_batches * trial.token_budget),
           "--deepspeed_config", str(folder / "ds_config.json"), "--max-steps", str(steps + warmup),
           "--no-export", "--no-progress", "--overwrite",  # a trial folder is the tuner's own: reruns start over
           "--checkpoint-every", str(10 ** 9), "--eval-every", str(10 ** 9),
           "--activation-checkpointing" if trial.activation_checkpointing else "--no-activation-checkpointing"]
    log = folder / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        start = time.monotonic()
        while (done := os.wait4(proc.pid, os.WNOHANG))[0] == 0:
            if time.monotonic() - start > timeout:
                proc.kill()
                done = os.wait4(proc.pid, 0)
                break
            time.sleep(0.5)
    _, status, usage = done
    proc.returncode = os.waitstatus_to_exitcode(status)
    # ru_maxrss of the launcher includes its ranks once they were waited for (KiB on Linux)
    trial.peak_memory_mib = usage.ru_maxrss / 1024
    text = log.read_text(errors="replace")
    records = [r for r in map(json.loads, metrics.open()) if r["kind"] == "train"] if metrics.is_file() else []
    measured = records[warmup:]
    if proc.returncode == 0 and measured:
        seconds = sum(r["step_seconds"] for r in measured)
        trial.status, trial.tokens_per_s = "ok", sum(r["real_tokens"] for r in measured) / seconds
        trial.step_seconds = seconds / len(measured)
        gpu = [r["peak_memory_mib"] for r in measured if r.get("peak_memory_mib")]
        if gpu:
            trial.peak_memory_mib = max(gpu)
    elif OOM.search(text):
        trial.status, trial.detail = "oom", "out of memory"
    else:
        trial.status = "error"
        lines = [RANK_PREFIX.sub("", ln) for ln in text.splitlines() if ln.strip()]
        # the trainer's message or the exception, not the launcher's "exits with return code" line
        reason = next((ln for ln in reversed(lines) if ln.startswith("error: ") or EXCEPTION.match(ln)),
                      lines[-1] if lines else "no output")
        trial.detail = f"timed out after {timeout:.0f}s" if time.monotonic() - start > timeout else reason[:300]
    return trial


def summary_table(trials: list[Trial]) -> str:
    head = f"{'trial':<28} {'status':<6} {'tokens/s':>10} {'step s':>8} {'peak MiB':>9}  detail"
    lines = [head, "-" * len(head)]
    for t in sorted(trials, key=lambda t: -t.tokens_per_s):
        lines.append(f"{t.name:<28} {t.status:<6} {t.tokens_per_s:>10,.0f} {t.step_seconds:>8.3f} "
                     f"{t.peak_memory_mib:>9,.0f}  {t.detail}")
    return "\n".join(lines)


def best(trials: list[Trial]) -> Trial:
    ok = [t for t in trials if t.status == "ok"]
    if not ok:
        raise UserError("no trial finished; see the trial logs (and the summary table) for why")
    return max(ok, key=lambda t: t.tokens_per_s)
