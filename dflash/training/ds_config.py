"""The user's DeepSpeed JSON, with the sizes the trainer owns filled in where it says "auto".

The trainer owns the micro-batch and accumulation sizes (one micro-batch is a token budget,
and the number per optimizer step varies), so those must be "auto" or the values below; the
optimizer and schedule come from the training options.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

import torch

from dflash.devices import resolve_dtype
from dflash.errors import UserError

# keys whose "auto" the trainer fills, and the only values it accepts there
OWNED = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}


def shipped_ds_configs() -> Path:
    """The folder of the DeepSpeed JSONs that ship with the package (`ds_configs/` in a checkout links to it)."""
    return Path(str(resources.files("dflash") / "ds_configs"))


def resolve_ds_config(path: str | Path) -> Path:
    """`path` from the current folder when it is there; else a shipped config named `zero2.json`, `zero2` or
    `ds_configs/zero2.json` (the default), so the defaults and the docs' commands work from any folder."""
    path = Path(path)
    if path.is_file() or path.is_absolute() or path.parent not in (Path("."), Path("ds_configs")):
        return path
    shipped = shipped_ds_configs() / (path.name if path.suffix == ".json" else f"{path.name}.json")
    return shipped if shipped.is_file() else path


def load_ds_config(path: str | Path, *, world_size: int, grad_clip: float, bf16: bool,
                   flag: str = "--deepspeed_config") -> dict:
    """The checked config with the trainer's sizes filled in; `flag` names the option in errors."""
    path = resolve_ds_config(path)
    if not path.is_file():
        ready = ", ".join(p.name for p in sorted(shipped_ds_configs().glob("*.json")))
        raise UserError(f"{flag} {path}: no such file (shipped, usable by name from anywhere: {ready})")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f"line {e.lineno} ({e.msg})" if isinstance(e, json.JSONDecodeError) else str(e)
        raise UserError(f"{flag} {path}: invalid JSON at {where}") from None
    if not isinstance(config, dict):
        raise UserError(f"{flag} {path}: expected a JSON object")
    named = f"{flag} {path}"

    def fill(key, value):
        if config.get(key, "auto") not in ("auto", value):
            raise UserError(
                f"{named}: '{key}' is {config[key]!r}; the trainer sets it to {value} "
                "(a micro-batch is a token budget, steps are counted in tokens): write \"auto\""
            )
        config[key] = value

    for key, value in OWNED.items():
        fill(key, value)
    fill("train_batch_size", world_size)
    if config.get("managed_gradient_accumulation", False) is not False:
        raise UserError(f"{named}: 'managed_gradient_accumulation' must be false: the "
                        "trainer runs a varying number of micro-batches per optimizer step")
    config["managed_gradient_accumulation"] = False
    if config.get("gradient_clipping", "auto") == "auto":
        config["gradient_clipping"] = grad_clip
    for section, enabled in (("bf16", bf16), ("fp16", False)):
        sub = config.get(section)
        if isinstance(sub, dict) and sub.get("enabled") == "auto":
            sub["enabled"] = enabled
    if "optimizer" in config or "scheduler" in config:
        raise UserError(f"{named}: remove 'optimizer'/'scheduler'; they come from the training "
                        "options (--lr, --weight-decay, --warmup-ratio, --schedule)")
    leftover = [k for k, v in _walk(config) if v == "auto"]
    if leftover:
        raise UserError(f"{named}: the trainer cannot fill 'auto' at {', '.join(leftover)}")
    _check_with_deepspeed(config, named)
    zero = config.get("zero_optimization", {})
    if zero.get("stage", 0) == 0:
        raise UserError(f"{named}: ZeRO stage 0 is not supported: the trainer relies on the ZeRO "
                        "optimizers to skip steps with non-finite gradients; use stage 1 (ds_configs/zero1.json), "
                        "which costs the same on one GPU")
    if zero.get("stage", 0) == 3 and zero.get("overlap_comm", True):
        raise UserError(f"{named}: ZeRO-3 needs 'overlap_comm': false with a varying number of "
                        "micro-batches per step (DeepSpeed's unmanaged accumulation)")
    return config


def precision(config: dict) -> str | None:
    """"bf16" or "fp16" when the config switches one on (DeepSpeed then trains in it), else None."""
    for section in ("bf16", "fp16"):
        if isinstance(config.get(section), dict) and config[section].get("enabled") is True:
            return section
    return None


# pydantic model of a config section -> its key, for error messages
_SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization",
             "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
             "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param"}


class _KeyRecorder(dict):
    """A config dict that records which top-level keys DeepSpeed looks up."""

    def __init__(self, *args):
        super().__init__(*args)
        self.asked = set()

    def get(self, key, *default):
        self.asked.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.asked.add(key)
        return super().__contains__(key)

    def keys(self):
        recorder = self

        class Keys:
            def __contains__(self, key):
                return key in recorder

            def __iter__(self):
                return iter(dict.keys(recorder))

        return Keys()


def _check_with_deepspeed(config: dict, named: str) -> None:
    """Parse the config with DeepSpeed itself, so that a typo fails here with the key named
    instead of being ignored: DeepSpeed silently skips unknown top-level keys, and its
    sections raise pydantic errors deep inside `deepspeed.initialize`."""
    import difflib

    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig

    # the batch sizes are checked against the world size; they are ours and already valid
    recorder = _KeyRecorder({k: v for k, v in config.items() if k != "train_batch_size"})
    try:
        DeepSpeedConfig(recorder)
    except pydantic.ValidationError as e:
        section = _SECTIONS.get(e.title, e.title)
        where = [f"{'.'.join([section, *map(str, err['loc'])])}: {err['msg']} (got {err.get('input')!r})"
                 for err in e.errors()]
        raise UserError(f"{named}: DeepSpeed rejects\n  " + "\n  ".join(where)
                        + "\n(the keys and values: https://www.deepspeed.ai/docs/config-json/)") from None
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise UserError(f"{named}: DeepSpeed rejects it: {e}") from None
    unknown = [k for k in config if k not in recorder.asked and k != "train_batch_size"]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(recorder.asked), n=1)
        hint = f"did you mean {close[0]!r}?" if close else "DeepSpeed would silently ignore it"
        raise UserError(f"{named}: unknown key {unknown[0]!r} ({hint})")
    clip = config.get("gradient_clipping", 0.0)
    if not isinstance(clip, (int, float)) or isinstance(clip, bool):
        raise UserError(f"{named}: 'gradient_clipping' must be a number, got {clip!r}")
    for section in ("bf16", "fp16"):
        if section in config and not (isinstance(config[section], dict)
                                      and isinstance(config[section].get("enabled", False), bool)):
            raise UserError(f"{named}: '{section}' must be an object with 'enabled': true/false")


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


def training_ds_config(path: str | Path, dtype_option: str, *, device, world_size: int,
                       grad_clip: float) -> tuple[dict, torch.dtype]:
    """The checked DeepSpeed config and the dtype the run trains in: --dtype, or what the JSON
    switches on (DeepSpeed trains in it whatever the trainer was told)."""
    dtype = resolve_dtype(dtype_option, device)
    ds_config = load_ds_config(path, world_size=world_size, grad_clip=grad_clip, bf16=dtype == torch.bfloat16)
    chosen = precision(ds_config)
    if chosen == "fp16":
        raise UserError(f"--deepspeed_config {path}: fp16 is not supported (the drafter trains in "
                        "bf16 or fp32); use \"bf16\": {\"enabled\": \"auto\"} with --dtype bf16")
    if chosen == "bf16" and dtype_option == "fp32":
        raise UserError(f"--deepspeed_config {path}: enables bf16, but --dtype is fp32; "
                        "write \"bf16\": {\"enabled\": \"auto\"} to follow --dtype")
    return ds_config, torch.bfloat16 if chosen == "bf16" else dtype


@contextmanager
def muon_split(module):
    """Around `deepspeed.initialize`: after DeepSpeed tags each parameter for Muon or its AdamW (inside
    `initialize`, by shape and name, overwriting any tag set before: every parameter of two or more
    dimensions whose name holds neither 'embed' nor 'lm_head' goes to Muon), the parameters whose names
    match one of `module.adamw_parameters` (fnmatch patterns the drafter class declares: lookup tables and
    kernels that are no matrices, as a convolution drafter's codebooks and base kernels) go to AdamW, by the
    rule DeepSpeed applies to embeddings. Without patterns, or without Muon, nothing changes."""
    import deepspeed

    patterns = tuple(getattr(module, "adamw_parameters", ()))
    tag = deepspeed.set_optimizer_flags

    def set_flags(config_class, model):
        tag(config_class, model)
        for name, param in model.named_parameters():
            if getattr(param, "use_muon", False) and any(fnmatch(name, p) for p in patterns):
                param.use_muon = False

    deepspeed.set_optimizer_flags = set_flags
    try:
        yield
    finally:
        deepspeed.set_optimizer_flags = tag


def with_optimizer(config: dict, optimizer: str, *, lr: float, muon_lr: float, momentum: float,
                   weight_decay: float, named: str) -> dict:
    """The checked config with --optimizer's section: none for AdamW (the trainer hands DeepSpeed a
    torch optimizer), DeepSpeed's own Muon (`MuonWithAuxAdam`) for muon. It tags, by shape, every
    parameter of two or more dimensions whose name holds neither 'embed' nor 'lm_head' for Muon and
    gives the rest to its AdamW, and so do the drafter's `adamw_parameters` (`muon_split`); the trainer's
    schedule scales both learning rates alike."""
    from dflash.training.config import MUON_NO_CLIP

    if optimizer != "muon":
        return config
    zero = config.get("zero_optimization", {})
    if offloads_optimizer(config):
        raise UserError(f"--optimizer muon: {named} offloads the optimizer, which dflash does not train Muon "
                        "with; use ds_configs/zero1.json, zero2.json or zero3.json, or --optimizer adamw")
    if config.get("gradient_clipping", 0) > 0:
        raise UserError(f"--optimizer muon: {named} sets 'gradient_clipping' {config['gradient_clipping']}; "
                        f"write \"auto\" or 0 ({MUON_NO_CLIP})")
    if zero.get("stage") == 3:
        if zero.get("reduce_scatter", False):
            raise UserError(f"--optimizer muon: {named} sets 'reduce_scatter' under ZeRO-3, which DeepSpeed's "
                            "Muon refuses; remove it")
        config = {**config, "zero_optimization": {**zero, "reduce_scatter": False}}
    return {**config, "optimizer": {"type": "Muon", "params": {
        "muon_lr": muon_lr, "adam_lr": lr, "momentum": momentum, "weight_decay": weight_decay,
        "betas": [0.9, 0.999], "eps": 1e-8}}}  # torch.optim.AdamW's, as the AdamW recipe
