"""The training configuration: one dataclass, `--help` from its field docs, YAML + overrides.

Precedence: dataclass defaults (the paper's recipe) < the built-in demo preset (only when
neither --target nor --data is given) < the YAML file of --config < command-line flags.
Unknown YAML keys and bad combinations are errors that name the key or flag.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from dflash.data.planner import DEFAULT_WINDOW, LAYOUTS, ORDERS
from dflash.errors import UserError

REPO = Path(__file__).resolve().parents[2]


@dataclass
class TrainConfig:
    # what to train on
    target: str = field(default="", metadata={"help": "Hugging Face causal LM folder of the frozen target (default: the built-in demo target)"})
    data: str = field(default="", metadata={"help": "token store folder, or a JSONL file of conversations prepared on the fly with the target's tokenizer (default: the demo data)"})
    output_dir: str = field(default="runs/demo", metadata={"help": "run folder: metrics, TensorBoard, checkpoints, exported drafter"})
    max_length: int = field(default=0, metadata={"help": "when --data is JSONL: truncate samples to this many tokens (0: the token budget)"})
    eval_fraction: float = field(default=0.02, metadata={"help": "share of samples held out for evaluation"})
    # batching
    order: str = field(default="shuffle", metadata={"help": f"batch order: {', '.join(ORDERS)}"})
    layout: str = field(default="packed", metadata={"help": f"micro-batch layout: {', '.join(LAYOUTS)}"})
    token_budget: int = field(default=16384, metadata={"help": "tokens per micro-batch (padded: count x longest; packed: sum of lengths)"})
    step_tokens: int = field(default=0, metadata={"help": "real tokens per rank per optimizer step; micro-batches are added until a step reaches it (0: 4 x token budget)"})
    buckets: int = field(default=6, metadata={"help": "number of optimal length buckets for --order bucketed"})
    boundaries: str = field(default="", metadata={"help": "bucket boundaries instead of --buckets, e.g. 770,1216,1728"})
    packing_window: int = field(default=DEFAULT_WINDOW, metadata={"help": "open bins of the best-fit packer"})
    # optimisation (the paper's recipe)
    epochs: int = field(default=6, metadata={"help": "passes over the training split"})
    max_steps: int = field(default=0, metadata={"help": "train this many optimizer steps in all (0: all epochs); the schedule spans them"})
    stop_at_step: int = field(default=0, metadata={"help": "stop after this step with a checkpoint, as if interrupted; --resume continues the same schedule"})
    lr: float = field(default=6e-4, metadata={"help": "peak AdamW learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_ratio: float = field(default=0.04, metadata={"help": "share of steps of linear warm-up"})
    schedule: str = field(default="cosine", metadata={"help": "learning-rate schedule after warm-up: cosine, linear, constant"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient clipping norm (fills 'gradient_clipping': 'auto')"})
    # drafter
    num_anchors: int = field(default=512, metadata={"help": "anchors drawn per sample (fewer if it has fewer candidates)"})
    block_size: int = field(default=16, metadata={"help": "drafted tokens per block, anchor slot included"})
    gamma: float = field(default=0.0, metadata={"help": "loss decay exp(-(k-1)/gamma) (0: 7/5/4 for block 16/10/8)"})
    draft_layers: int = field(default=5, metadata={"help": "drafter decoder layers"})
    target_layer_ids: str = field(default="", metadata={"help": "tapped target layers, e.g. 1,9,17,25,33 (default: the official rule)"})
    num_target_features: int = field(default=5, metadata={"help": "number of taps when --target-layer-ids is not given"})
    activation_checkpointing: bool = field(default=False, metadata={"help": "recompute drafter layers in backward: less activation memory, about a third more drafter compute"})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on GPU, fp32 on CPU), bf16, fp32"})
    attention_backend: str = field(default="auto", metadata={"help": "dflash.ops backend: auto (Triton on CUDA), triton, torch"})
    seed: int = field(default=0, metadata={"help": "seed of the planner, anchors, split and initialisation"})
    # run control
    deepspeed_config: str = field(default="ds_configs/zero2.json", metadata={"help": "DeepSpeed JSON; 'auto' values are filled from these options"})
    resume: bool = field(default=False, metadata={"help": "continue from the newest complete checkpoint in the output dir"})
    force_resume: bool = field(default=False, metadata={"help": "resume even if data, world size or planner settings changed (prints what changes)"})
    eval_every: int = field(default=0, metadata={"help": "evaluate loss and tau every N steps (0: once per epoch and at the end)"})
    checkpoint_every: int = field(default=0, metadata={"help": "save a checkpoint every N steps (0: at the end of each epoch)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "how many of the newest checkpoints to keep"})
    log_every: int = field(default=1, metadata={"help": "write metrics every N steps (a host sync point)"})
    num_workers: int = field(default=1, metadata={"help": "data-loader worker processes collating micro-batches ahead of compute"})
    sample_log: bool = field(default=False, metadata={"help": "write which samples every step used to samples.rank<N>.jsonl (store indices)"})
    max_nonfinite_steps: int = field(default=5, metadata={"help": "stop (with a checkpoint) after this many optimizer steps in a row with non-finite loss or gradients; each is skipped"})
    export: bool = field(default=True, metadata={"help": "export the drafter (save_pretrained) at the end"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar on rank 0"})


# The built-in demo: the tiny target and the data it regenerated, sized to run on a laptop CPU
# in a few minutes.
DEMO_PRESET = {
    "output_dir": "runs/demo",
    "token_budget": 4096,
    "step_tokens": 4096,  # many small steps: on this data the drafter learns faster per token
    "epochs": 3,
    "lr": 3e-3,
    "num_anchors": 64,
    "draft_layers": 2,
    "num_target_features": 3,
    "eval_fraction": 0.05,
    "eval_every": 9,
    "max_length": 1024,
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file of options (keys as below, with underscores)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the launcher
    for f in dataclasses.fields(TrainConfig):
        kwargs = {"dest": f.name, "default": None, "help": f"{f.metadata['help']} (default: {f.default!r})"}
        if f.type in ("bool", bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
        names = [_flag(f.name)] + (["--deepspeed_config"] if f.name == "deepspeed_config" else [])
        p.add_argument(*names, **kwargs)
    return p


def load_config(argv=None, description: str = "") -> TrainConfig:
    """Parse flags (and --config YAML) into a validated TrainConfig."""
    args = build_parser(description).parse_args(argv)
    values = {}
    if args.config:
        values.update(_read_yaml(args.config))
    cli = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if getattr(args, f.name) is not None}
    values.update(cli)
    if not values.get("target") and not values.get("data"):
        values = {**DEMO_PRESET, **values}
    config = TrainConfig(**values)
    validate(config)
    return config


def _read_yaml(path: str) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of option: value")
    known = {f.name: f for f in dataclasses.fields(TrainConfig)}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise UserError(f"--config {path}: unknown key {key!r} (see `train.py --help` for the options)")
        out[name] = _typed(value, known[name], f"--config {path}: {key!r}")
    return out


def _typed(value, f: dataclasses.Field, where: str):
    """A YAML value as the option's type. YAML reads `1e-3` as a string and `[1, 9]` as a list."""
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise UserError(f"{where} must be true or false, got {value!r}")
    if kind == "str":
        if isinstance(value, list) and all(isinstance(v, int) for v in value):
            return ",".join(map(str, value))  # e.g. target_layer_ids: [1, 9, 17]
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"{where} must be a string, got {value!r}")
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
        if kind == "int":
            if number != int(number):
                raise ValueError
            return int(number)
        return number
    except (TypeError, ValueError):
        raise UserError(f"{where} must be {'an integer' if kind == 'int' else 'a number'}, got {value!r}") from None


def validate(c: TrainConfig) -> None:
    def bad(flag, why):
        raise UserError(f"{_flag(flag)}: {why}")

    if c.order not in ORDERS:
        bad("order", f"must be one of {', '.join(ORDERS)}, got {c.order!r}")
    if c.layout not in LAYOUTS:
        bad("layout", f"must be one of {', '.join(LAYOUTS)}, got {c.layout!r}")
    if c.schedule not in ("cosine", "linear", "constant"):
        bad("schedule", f"must be cosine, linear or constant, got {c.schedule!r}")
    if c.dtype not in ("auto", "bf16", "fp32"):
        bad("dtype", f"must be auto, bf16 or fp32, got {c.dtype!r}")
    for name in ("token_budget", "epochs", "num_anchors", "block_size", "draft_layers", "buckets", "packing_window",
                 "keep_checkpoints", "log_every", "num_target_features", "max_nonfinite_steps"):
        if getattr(c, name) < 1:
            bad(name, f"must be >= 1, got {getattr(c, name)}")
    if c.block_size < 2:
        bad("block_size", "must be >= 2 (slot 0 holds the anchor)")
    if c.gamma == 0 and c.block_size not in (8, 10, 16):
        bad("gamma", f"no default for block size {c.block_size}; give --gamma")
    if not 0 <= c.warmup_ratio < 1:
        bad("warmup_ratio", f"must be in [0, 1), got {c.warmup_ratio}")
    if not 0 <= c.eval_fraction < 1:
        bad("eval_fraction", f"must be in [0, 1), got {c.eval_fraction}")
    for name in ("step_tokens", "max_steps", "stop_at_step", "max_length", "num_workers", "eval_every", "checkpoint_every"):
        if getattr(c, name) < 0:
            bad(name, f"must be >= 0, got {getattr(c, name)}")
    if c.lr <= 0:
        bad("lr", f"must be positive, got {c.lr}")
    if c.force_resume and not c.resume:
        bad("force_resume", "only makes sense with --resume")


def parse_int_list(text: str, flag: str) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated integers, got {text!r}") from None
