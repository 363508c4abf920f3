"""Run metrics on rank 0: one JSON line per record in metrics.jsonl, and TensorBoard scalars."""
from __future__ import annotations

import json
from pathlib import Path


class MetricsWriter:
    def __init__(self, output_dir: str | Path, enabled: bool):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))

    def write(self, kind: str, step: int, values: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
