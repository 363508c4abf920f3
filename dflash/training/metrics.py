"""Run metrics on rank 0: one JSON line per record in metrics.jsonl, and TensorBoard scalars."""
from __future__ import annotations

import json
import math
from pathlib import Path

from dflash.distributed.run_folder import RunPaths
from dflash.errors import UserError, os_reason
from dflash.partial import replace_file


def trim_jsonl(path: Path, last_step: int) -> None:
    """Keep the records of steps <= last_step (and drop a line cut short by a crash); all or
    nothing, and a full disk is one line that leaves the file as it was and no temporary file."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record["step"] <= last_step:
            kept.append((line + "\n").encode())
    try:
        replace_file(path, kept)
    except OSError as err:
        raise UserError(f"{path}: cannot cut it back to step {last_step} for the resume ({os_reason(err, path)}); "
                        "it is unchanged: free some space and --resume again") from None


def step_metrics(sums, slot) -> dict:
    """Loss, anchor tau (mean acceptance of the random-anchor blocks) and per-slot accuracy from
    summed drafter outputs.

    sums: (loss_sum, weight_sum, tau_sum, num_blocks); slot: (2, B-1) correct and scored labels
    per slot. Totals over micro-batches and ranks: the loss is weighted as one big batch.
    """
    loss, weight, tau, blocks = (float(v) for v in sums)
    correct, count = slot
    return {"loss": loss / max(weight, 1e-12), "anchor_tau": tau / blocks if blocks else 0.0, "blocks": int(blocks),
            "slot_accuracy": (correct / count.clamp_min(1)).tolist()}


def _finite_or_none(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


class MetricsWriter:
    def __init__(self, output_dir: str | Path, enabled: bool, resume_step: int | None = None):
        """`resume_step`: the run continues after this step; later records (of a crashed
        attempt) are removed from the JSONL and from TensorBoard."""
        self.enabled = enabled
        self.path = RunPaths(Path(output_dir)).metrics
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                trim_jsonl(self.path, resume_step)
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                purge = None if resume_step is None else resume_step + 1
                self._tb = SummaryWriter(str(RunPaths(Path(output_dir)).tensorboard), purge_step=purge)

    def write(self, kind: str, step: int, values: dict) -> None:
        if not self.enabled:
            return
        # strict JSON: a skipped step's NaN loss is written as null
        values = {k: _finite_or_none(v) for k, v in values.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_records(run: Path) -> list[dict]:
    """The records of a run folder's metrics.jsonl."""
    path = RunPaths(Path(run)).metrics
    if not path.is_file():
        raise UserError(f"{run}: no metrics.jsonl (is it a launch/train.py output dir?)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            raise UserError(f"{path}:{number}: not a JSON record") from None
    return records


def _temperature(key: str) -> float | None:
    """T of a key tau@T (None for other keys, e.g. tau@1_stderr)."""
    if not key.startswith("tau@"):
        return None
    try:
        return float(key.removeprefix("tau@"))
    except ValueError:
        return None


def sampled_tau_keys(records: list[dict]) -> list[str]:
    """The eval records' tau@T keys for T > 0 (tau@0 is tau), in order of temperature."""
    keys = {k for r in records if r["kind"] == "eval" for k in r if (_temperature(k) or 0) > 0}
    return sorted(keys, key=_temperature)


def tau_at_words(record: dict) -> list[str]:
    """An eval record's tau@T for T > 0, with the standard error when it has one: 'tau@1 1.412 +- 0.084'."""
    words = []
    for key in sampled_tau_keys([{**record, "kind": "eval"}]):
        err = record.get(key + "_stderr")
        words.append(f"{key} {record[key]:.3f}" + (f" +- {err:.3f}" if err is not None else ""))
    return words


def training_seconds(records: list[dict]) -> dict[int, float]:
    """Each step's training time so far (the steps' own seconds summed, evaluations left out)."""
    total, at = 0.0, {}
    for r in records:
        if r["kind"] == "train":
            total += r.get("step_seconds") or 0.0
            at[r["step"]] = total
    return at


def plot_curves(records: list[dict], output: Path, title: str, x: str = "step") -> None:
    """Loss and acceptance against the step (x="seconds": the training time so far), training
    records and held-out evaluations, as a PNG: the walk tau of the evaluations (what greedy
    decoding reaches) and tau@T (the expected acceptance of speculative sampling at T) beside the
    anchor tau of both."""
    if x not in ("step", "seconds"):
        raise ValueError(f"x must be step or seconds, got {x!r}")
    seconds = training_seconds(records)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    curves = {"loss": [("train", "loss", "-", "train"), ("eval", "loss", "o-", "held out")],
              "acceptance length": [("train", "anchor_tau", "-", "train anchor_tau"),
                                    ("eval", "anchor_tau", "s--", "held-out anchor_tau"),
                                    ("eval", "tau", "o-", "held-out tau (decoding walk, greedy)")]
              + [("eval", key, "^-", f"held-out {key} (sampling at T={key.removeprefix('tau@')}, expected)")
                 for key in sampled_tau_keys(records)]}
    for ax, (ylabel, lines) in zip(axes, curves.items(), strict=True):
        for kind, key, style, label in lines:
            rows = [r for r in records if r["kind"] == kind and key in r and (x == "step" or r["step"] in seconds)]
            xs = [r["step"] if x == "step" else seconds[r["step"]] / 60 for r in rows]
            y = [float("nan") if r[key] is None else r[key] for r in rows]
            err = [r.get(key + "_stderr") for r in rows]
            if any(e is not None for e in err):  # tau@T with its standard error over turns
                ax.errorbar(xs, y, yerr=[0.0 if e is None else e for e in err], fmt=style, capsize=3, label=label)
            else:
                ax.plot(xs, y, style, label=label, alpha=0.6 if kind == "train" else 1.0)
        ax.set_xlabel("optimizer step" if x == "step" else "training time, minutes (evaluations left out)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
