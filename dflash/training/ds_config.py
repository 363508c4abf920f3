"""The user's DeepSpeed JSON, with the sizes the trainer owns filled in where it says "auto".

The trainer owns the micro-batch and accumulation sizes (one micro-batch is a token budget,
and the number per optimizer step varies), so those must be "auto" or the values below; the
optimizer and schedule come from the training options.
"""
from __future__ import annotations

import json
from pathlib import Path

from dflash.errors import UserError

# keys whose "auto" the trainer fills, and the only values it accepts there
OWNED = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}


def load_ds_config(path: str | Path, *, world_size: int, grad_clip: float, bf16: bool) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--deepspeed_config {path}: no such file (see ds_configs/ for ready ones)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"--deepspeed_config {path}: invalid JSON at line {e.lineno} ({e.msg})") from None
    if not isinstance(config, dict):
        raise UserError(f"--deepspeed_config {path}: expected a JSON object")

    def fill(key, value):
        if config.get(key, "auto") not in ("auto", value):
            raise UserError(
                f"--deepspeed_config {path}: '{key}' is {config[key]!r}; the trainer sets it to {value} "
                "(a micro-batch is a token budget, steps are counted in tokens): write \"auto\""
            )
        config[key] = value

    for key, value in OWNED.items():
        fill(key, value)
    fill("train_batch_size", world_size)
    if config.get("managed_gradient_accumulation", False) is not False:
        raise UserError(f"--deepspeed_config {path}: 'managed_gradient_accumulation' must be false: the "
                        "trainer runs a varying number of micro-batches per optimizer step")
    config["managed_gradient_accumulation"] = False
    if config.get("gradient_clipping", "auto") == "auto":
        config["gradient_clipping"] = grad_clip
    for section, enabled in (("bf16", bf16), ("fp16", False)):
        sub = config.get(section)
        if isinstance(sub, dict) and sub.get("enabled") == "auto":
            sub["enabled"] = enabled
    if "optimizer" in config or "scheduler" in config:
        raise UserError(f"--deepspeed_config {path}: remove 'optimizer'/'scheduler'; they come from the training "
                        "options (--lr, --weight-decay, --warmup-ratio, --schedule)")
    leftover = [k for k, v in _walk(config) if v == "auto"]
    if leftover:
        raise UserError(f"--deepspeed_config {path}: the trainer cannot fill 'auto' at {', '.join(leftover)}")
    zero = config.get("zero_optimization", {})
    if zero.get("stage", 0) == 3 and zero.get("overlap_comm", True):
        raise UserError(f"--deepspeed_config {path}: ZeRO-3 needs 'overlap_comm': false with a varying number of "
                        "micro-batches per step (DeepSpeed's unmanaged accumulation)")
    return config


def _walk(d, prefix=""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _walk(v, key + ".")
        else:
            yield key, v


def zero_stage(config: dict) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def offloads_optimizer(config: dict) -> bool:
    return config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") not in ("none", None)
