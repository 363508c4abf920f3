"""The training configuration: one dataclass, `--help` from its field docs, YAML + overrides.

Precedence: dataclass defaults (the paper's recipe) < the built-in demo preset (only when
neither --target nor --data is given) < the YAML file of --config < command-line flags.
`load_config` resolves every option once: lists become tuples (of ints, or floats where said), derived defaults
(step tokens, maximum length, gamma) are filled in, and every value is checked, so a bad one
fails before anything loads. The rest of the code reads the result and interprets nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from dflash import demo
from dflash.data.planner import DEFAULT_WINDOW, LAYOUTS, ORDERS
from dflash.data.vocab import MASK_TOKEN
from dflash.errors import UserError
from dflash.models.config_format import DFLASH2_SLIDING_WINDOW, FULL, LAYER_TYPES, SLIDING
from dflash.models.loss import GAMMA_BY_BLOCK_SIZE
from dflash.ops import ATTENTION_BACKENDS
from dflash.options import number, parse_list

TARGET_PARTITIONS = ("none", "zero3")
DRAFTER_KINDS = ("dflash", "dflash2")


def layer_type(name: str) -> str:
    """A drafter layer type from its short or full name (sliding / full, or as in config.json)."""
    full = {"sliding": SLIDING, "full": FULL}.get(name, name)
    if full not in LAYER_TYPES:
        raise ValueError(name)
    return full


layer_type.expected = "sliding or full"


OPTIMIZERS = ("adamw", "muon")
# DeepSpeed 0.19.8 scales the Muon update (fixed norm: Newton-Schulz) by the clip factor of the raw
# gradient's norm, which shrinks it by orders of magnitude (measured: 1.5e-6 RMS against 7.9e-4 unclipped)
MUON_NO_CLIP = "DeepSpeed clips Muon's orthogonalised update by the raw gradient's norm, shrinking it"


def _opt(default, help: str, list_options: dict | None = None):
    """An option: its default, its `--help` text and, for a comma-separated list, how to check it."""
    return field(default=default, metadata={"help": help, **({"list": list_options} if list_options else {})})


SPECULATE_TURNS_MAX = 100  # held-out turns decoded at the end of a run of at least as many steps


def speculate_turns(c: TrainConfig, total_steps: int) -> int:
    """Held-out turns to decode at the end: --speculate-turns, or with -1 one per optimizer step of
    the run, at most SPECULATE_TURNS_MAX (a 4-step run decodes 4 turns, not 100)."""
    return c.speculate_turns if c.speculate_turns >= 0 else min(total_steps, SPECULATE_TURNS_MAX)


@dataclass
class TrainConfig:
    # what to train on
    target: str = _opt(
        str(demo.TARGET),
        "Hugging Face causal LM folder of the frozen target (default: the built-in demo target); "
        "random:qwen3-8b or random:PATH (PATH holding a config.json): random weights of that shape and a synthetic "
        "tokenizer, to benchmark before downloading anything (data: random)",
    )
    data: str = _opt(
        str(demo.DATA),
        "token store folder, or conversations (a JSONL, JSON, parquet or Arrow file, a folder of parquet shards, a "
        "datasets save_to_disk folder) prepared on the fly with the target's tokenizer "
        "(default: the demo data); random or random:SAMPLES: synthetic samples with seed-like lengths and random "
        "token ids, made in memory (default with a random target; 10,000 samples)",
    )
    messages_field: str = _opt(
        "", "when --data is a parquet, Arrow, JSON or datasets folder: the column holding each conversation's turns "
        "({role, content} or ShareGPT {from, value}); default: messages, else conversations",
    )
    output_dir: str = _opt("runs/demo", "run folder: metrics, TensorBoard, checkpoints, exported drafter")
    max_length: int = _opt(0, "when --data is not a store: truncate samples to this many tokens (0: the token budget)")
    eval_fraction: float = _opt(0.02, "share of samples held out for evaluation")
    subset_tokens: int = _opt(
        0,
        "train on a random subset of the training split holding about this many tokens, the same samples whatever "
        "the order and layout (benchmarks: compare_modes.py times every mode on one subset); 0: all",
    )
    # batching
    order: str = _opt("shuffle", f"batch order: {', '.join(ORDERS)}")
    layout: str = _opt("packed", f"micro-batch layout: {', '.join(LAYOUTS)}")
    token_budget: int = _opt(16384, "tokens per micro-batch (padded: count x longest; packed: sum of lengths)")
    step_tokens: int = _opt(
        0,
        "real tokens per rank per optimizer step; micro-batches are added until a step reaches it (0: 4 x token "
        "budget)",
    )
    buckets: int = _opt(6, "number of optimal length buckets for --order bucketed")
    boundaries: tuple[int, ...] | None = _opt(
        None,
        "bucket boundaries instead of --buckets, e.g. 770,1216,1728",
        list_options={"increasing": True, "minimum": 1},
    )
    packing_window: int = _opt(DEFAULT_WINDOW, "open bins of the best-fit packer")
    row_budget: int = _opt(
        0,
        "drafter block rows per micro-batch at most (block size x anchors per sample, summed; the drafter's "
        "activations grow with them); 0: the most that fits in --memory-gib by the memory plan (no cap when no "
        "memory is known: a CPU run without --memory-gib)",
    )
    balance: bool = _opt(
        True,
        "deal micro-batches of similar cost (target tokens and attention, drafter rows) to the ranks of each "
        "micro-step, so that ranks wait less for each other (changes nothing on one rank)",
    )
    cost_model: str = _opt(
        "",
        "JSON cost model for --balance (coefficients as written by compare_modes.py's calibration, "
        "cost_model.json); empty: FLOPs from the target's and drafter's sizes",
    )
    time_micro_batches: bool = _opt(
        False,
        "time every micro-batch (a device sync after each) and log the times with their cost features, to "
        "calibrate the cost model",
    )
    time_phases: bool = _opt(
        False,
        "time the phases of every logged step with device events (target forward, drafter forward and backward, "
        "loss, optimizer; no sync of their own) and log them as phase_seconds",
    )
    # optimisation (the paper's recipe)
    epochs: int = _opt(6, "passes over the training split")
    max_steps: int = _opt(0, "train this many optimizer steps in all (0: all epochs); the schedule spans them")
    stop_at_step: int = _opt(
        0,
        "stop after this step with a checkpoint, as if interrupted; --resume continues the same schedule",
    )
    optimizer: str = _opt(
        "adamw",
        f"{', '.join(OPTIMIZERS)}: muon is DeepSpeed's Muon (MuonWithAuxAdam, ZeRO 1-3): Muon for the drafter's "
        "matrices, AdamW at --lr for the rest (norms, biases); no gradient clipping with it (--grad-clip 0)",
    )
    lr: float = _opt(6e-4, "peak AdamW learning rate")
    muon_lr: float = _opt(0.0, "muon: peak Muon learning rate (0: 10 x --lr, speculators' ratio)")
    muon_momentum: float = _opt(0.95, "muon: Muon's momentum")
    weight_decay: float = _opt(0.0, "AdamW (and Muon) weight decay")
    warmup_ratio: float = _opt(0.04, "share of steps of linear warm-up")
    schedule: str = _opt("cosine", "learning-rate schedule after warm-up: cosine, linear, constant")
    grad_clip: float = _opt(1.0, "gradient clipping norm (fills 'gradient_clipping': 'auto'); with --optimizer "
                            "muon the default is 0")
    # objective
    loss: str = _opt(
        "ce=1",
        "the objective, comma-separated part=weight: ce (slot-weighted cross-entropy with the data), dpace (D-PACE: "
        "cross-entropy weighted by each slot's share of the block's expected acceptance, no gamma decay), kl "
        "(KL(target || drafter) at --distill-temperature), lk (-log of the expected acceptance sum_v min(p, q) at "
        "--distill-temperature); e.g. ce=1,dpace=0.5 or ce=0.5,kl=1. kl and lk run the target to its last layer",
    )
    dpace_alpha: float = _opt(0.5, "D-PACE confidence smoothing: a slot's confidence counts as (1 - a) q + a")
    distill_temperature: float = _opt(1.0, "temperature of the target's and the drafter's softmax in kl and lk")
    feature_noise: float = _opt(
        0.0,
        "std of Gaussian noise added to the tapped target features in training (not evaluation), the same for a "
        "sample in an epoch whatever its micro-batch (seeded by --seed, epoch, sample); 0: none",
    )
    # drafter
    num_anchors: int = _opt(512, "anchors drawn per sample (fewer if it has fewer candidates)")
    block_size: int = _opt(16, "drafted tokens per block, anchor slot included")
    gamma: float = _opt(0.0, "loss decay exp(-(k-1)/gamma) (0: 7/5/4 for block 16/10/8)")
    draft_layers: int = _opt(5, "drafter decoder layers")
    target_layer_ids: tuple[int, ...] | None = _opt(
        None,
        "tapped target layers, e.g. 1,9,17,25,33 (default: the official rule)",
        list_options={"distinct": True, "minimum": 0},
    )
    num_target_features: int = _opt(5, "number of taps when --target-layer-ids is not given")
    mask_token: str = _opt(
        "",
        f"text of the token the drafter's block slots hold (empty: add {MASK_TOKEN} in a spare row of the target's "
        "embedding); an existing token the data never use, e.g. a reserved special token, when there is no spare row",
    )
    drafter_layer_types: tuple[str, ...] | None = _opt(
        None,
        "attention of each drafter layer, e.g. sliding,sliding,sliding,sliding,full: a sliding layer sees the last "
        "--sliding-window positions and is causal within the block, as vLLM and SGLang serve it (default: all full)",
        list_options={"cast": layer_type},
    )
    sliding_window: int = _opt(0, "positions a sliding drafter layer sees, its own included (config.json "
                               "sliding_window; needed with sliding layers)")
    drafter_kind: str = _opt(
        "dflash",
        f"{', '.join(DRAFTER_KINDS)}: dflash2 adds grouped dynamic causal convolutions around every sublayer and a "
        "candidate selector (z-lab's DFlash2DraftModel, sized as released: kernel 2, groups of 16 channels, top-16 "
        "candidates, rank 256); its layers default to the release's, all sliding over --sliding-window (default "
        f"{DFLASH2_SLIDING_WINDOW}) and not causal (is_causal false)",
    )
    selector_weight: float = _opt(1.0, "dflash2: weight of the selector's loss (K-way cross-entropy over the top-K "
                                  "candidates) against the DFlash cross-entropy")
    selector_stop_grad: bool = _opt(False, "dflash2: the selector's loss trains the selector only (its gradient does "
                                    "not reach the drafter's layers)")
    init_drafter: str = _opt(
        "",
        "start from this drafter folder (official format, ours or a released one): its weights, block size, mask "
        "token, tapped layers and layer types, checked against the target; the optimizer starts fresh (--resume "
        "still continues a checkpoint)",
    )
    activation_checkpointing: bool = _opt(
        False,
        "recompute drafter layers in backward: less activation memory, about a third more drafter compute",
    )
    dtype: str = _opt("auto", "auto (bf16 on GPU, fp32 on CPU), bf16, fp32")
    target_partition: str = _opt(
        "none",
        f"{', '.join(TARGET_PARTITIONS)}: zero3 partitions the frozen target's parameters across all ranks "
        "(DeepSpeed ZeRO-3, a layer gathered as it runs): for targets larger than one GPU; none keeps a full copy "
        "per rank (fastest when it fits)",
    )
    target_offload: bool = _opt(
        False,
        "with --target-partition zero3: keep the target's partitions in CPU memory (copied to the GPU layer by "
        "layer; slower, for targets larger than all GPUs together)",
    )
    memory_gib: float = _opt(
        0.0,
        "accelerator memory per rank the run must fit in, GiB (0: the GPU's total memory; a CPU run: no limit); "
        "the memory plan refuses a run that cannot fit, before anything loads, and sizes --row-budget",
    )
    attention_backend: str = _opt("auto", f"dflash.ops backend: {', '.join(ATTENTION_BACKENDS)} (auto: Triton on "
                                  "CUDA; torch_varlen / flash_attn serve the target, the drafter then uses flex)")
    seed: int = _opt(0, "seed of the planner, anchors, split and initialisation")
    # run control
    deepspeed_config: str = _opt("ds_configs/zero2.json", "DeepSpeed JSON; 'auto' values are filled from these options")
    resume: bool = _opt(False, "continue from the newest complete checkpoint in the output dir")
    force_resume: bool = _opt(
        False,
        "resume even if data, world size or planner settings changed (prints what changes)",
    )
    overwrite: bool = _opt(
        False,
        "start over in a run folder that holds a previous run: delete that run's files (config, metrics, "
        "checkpoints, TensorBoard, export, sample logs) and nothing else",
    )
    eval_every: int = _opt(
        0,
        "evaluate on the held-out split every N steps (0: once per epoch and at the end): walk tau (what greedy "
        "speculative decoding reaches), anchor tau, per-slot accuracy, loss",
    )
    eval_temperatures: tuple[float, ...] = _opt(
        (0.0, 1.0),
        "temperatures of the eval walk, e.g. 0,0.7,1: tau@T, the expected acceptance length of speculative sampling "
        "at T (drafts drawn from the drafter at T, the engines' ratio test) along the held-out turns, beside "
        "greedy tau (tau@0 = tau; 0 alone: greedy only); exact in expectation when the turns were sampled at T",
        list_options={"cast": float, "distinct": True, "minimum": 0},
    )
    eval_sample_turns: int = _opt(
        100,
        "tau@T at a temperature T > 0 the held-out turns were not sampled at (their meta.temperature; unknown counts "
        "as not): walk the prompts of the first N held-out turns continued by the target alone at T (sampled once "
        "per run, the same at every evaluation, kept in eval_turns.json), so that tau@T is decoding's expected "
        "acceptance at T on those prompts, with its standard error tau@T_stderr; 0: walk the held-out turns as "
        "they are (tau@T then reads what decoding would accept had it produced them)",
    )
    speculate_turns: int = _opt(
        -1,
        "at the end, decode this many held-out assistant turns by speculative decoding with the exported drafter "
        f"and print the acceptance length (0: skip; -1: one per optimizer step of the run, at most "
        f"{SPECULATE_TURNS_MAX}, so that a short run stays short)",
    )
    checkpoint_every: int = _opt(0, "save a checkpoint every N steps (0: at the end of each epoch)")
    keep_checkpoints: int = _opt(2, "how many of the newest checkpoints to keep")
    log_every: int = _opt(1, "write metrics every N steps (a host sync point)")
    num_workers: int = _opt(1, "data-loader worker processes collating micro-batches ahead of compute")
    sample_log: bool = _opt(False, "write which samples every step used to samples.rank<N>.jsonl (store indices)")
    max_nonfinite_steps: int = _opt(
        5,
        "stop (with a checkpoint) after this many optimizer steps in a row with non-finite loss or gradients; "
        "each is skipped",
    )
    export: bool = _opt(True, "export the drafter (save_pretrained) at the end")
    progress: bool = _opt(True, "show a progress bar on rank 0")


# The built-in demo: the tiny target and the data it regenerated (the dataclass defaults), sized
# to run on a laptop CPU in a few minutes.
DEMO_PRESET = {
    "target": str(demo.TARGET),
    "data": str(demo.DATA),
    "output_dir": "runs/demo",
    # many small steps: on this data the drafter learns faster per token (2,048-token steps reach a
    # held-out decoding acceptance length above 2 in 3 epochs; 4,096-token steps stop at 1.6)
    "token_budget": 2048,
    "step_tokens": 2048,
    "epochs": 3,
    "lr": 3e-3,
    "num_anchors": 64,
    "draft_layers": 2,
    "num_target_features": 3,
    "eval_fraction": 0.05,
    "eval_every": 21,
    "max_length": 1024,
}


# A random target (--target random:...): synthetic data, no held-out decoding (its acceptance means nothing).
# random weights: no end of turn to decode to, and samples of noise to walk
RANDOM_TARGET_PRESET = {"data": "random", "output_dir": "runs/random", "speculate_turns": 0, "eval_sample_turns": 0}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _kind(f: dataclasses.Field) -> str:
    if "list" in f.metadata:
        return "list"
    return f.type if isinstance(f.type, str) else f.type.__name__


def _list_parser(f: dataclasses.Field, where: str):
    return lambda text: parse_list(text, where, **f.metadata["list"])


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file of options (keys as below, with underscores)")
    p.add_argument("--local_rank", "--local-rank", type=number(int, minimum=-1), default=-1,  # set by the launcher
                   help=argparse.SUPPRESS)
    for f in dataclasses.fields(TrainConfig):
        kwargs = {"dest": f.name, "default": None, "help": f"{f.metadata['help']} (default: {f.default!r})"}
        kind = _kind(f)
        if kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind == "list":
            kwargs["type"] = _list_parser(f, _flag(f.name))
        else:
            kwargs["type"] = {"int": int, "float": float, "str": str}[kind]
        names = [_flag(f.name)] + (["--deepspeed_config"] if f.name == "deepspeed_config" else [])
        p.add_argument(*names, **kwargs)
    return p


def load_config(argv=None, description: str = "") -> TrainConfig:
    """Parse flags (and --config YAML) into a resolved, validated TrainConfig."""
    from dflash.models.target_spec import is_random_target

    args = build_parser(description).parse_args(argv)
    values = {}
    if args.config:
        values.update(_read_yaml(args.config))
    cli = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if getattr(args, f.name) is not None}
    values.update(cli)
    explicit = set(values)  # the user's own options (YAML and flags), not the demo preset's
    if values.get("optimizer") == "muon" and "grad_clip" not in explicit:
        values["grad_clip"] = 0.0  # see MUON_NO_CLIP
    if "target" not in values and "data" not in values:
        values = {**DEMO_PRESET, **values}
    elif is_random_target(values.get("target", "")):
        values = {**RANDOM_TARGET_PRESET, **values}
    if values.get("init_drafter"):
        values = _from_init_drafter(values, explicit)
    return resolve(TrainConfig(**values))


def init_drafter_config(folder: str, spec):
    """The DrafterConfig of --init-drafter `folder`, checked against the target (its `TargetSpec`;
    raises UserError naming the field that disagrees). Reads config files and the weights' header only."""
    from dflash.models.config import DrafterConfig, check_fits_target
    from dflash.models.folders import check_drafter_folder

    path = Path(folder)

    def fits_target(drafter, raw):
        try:
            check_fits_target(drafter, spec.config, num_target_layers_given=DrafterConfig.gives_num_target_layers(raw))
        except ValueError as e:
            raise UserError(f"--init-drafter {path / 'config.json'} does not fit --target {spec.name}: {e}") from None

    # its files there, its config fitting the target, then its weights whole and the config's
    return check_drafter_folder(path, "--init-drafter", fits_target)


def _from_init_drafter(values: dict, explicit: set) -> dict:
    """values with the drafter options taken from --init-drafter; an explicit option that
    contradicts the drafter is an error naming both."""
    if values.get("mask_token"):
        raise UserError(f"--mask-token {values['mask_token']!r} contradicts --init-drafter {values['init_drafter']}: "
                        "the drafter's dflash_config.mask_token_id is its mask token (leave --mask-token out)")
    from dflash.models.target_spec import load_target_spec

    c = init_drafter_config(values["init_drafter"], load_target_spec(values.get("target", TrainConfig.target)))
    taken = {
        "block_size": c.block_size, "draft_layers": c.num_hidden_layers,
        "target_layer_ids": tuple(c.target_layer_ids), "num_target_features": c.num_target_features,
        "drafter_layer_types": tuple(c.layer_types), "sliding_window": c.sliding_window or 0,
        "drafter_kind": "dflash" if c.dflash2 is None else "dflash2",
    }
    for name, value in taken.items():
        given = values.get(name)
        if name in explicit and given is not None and given != value and not (
                name == "drafter_layer_types" and tuple(map(layer_type, given)) == value):
            raise UserError(f"{_flag(name)} {given!r} contradicts --init-drafter {values['init_drafter']}, whose "
                            f"value is {value!r} (leave {_flag(name)} out)")
    return {**values, **taken}


def resolve(c: TrainConfig) -> TrainConfig:
    """Check every option and fill in the defaults that depend on others (0 = derived)."""
    validate(c)
    if c.drafter_kind == "dflash2" and c.drafter_layer_types is None:  # the released layers
        c = dataclasses.replace(c, drafter_layer_types=(SLIDING,) * c.draft_layers,
                                sliding_window=c.sliding_window or DFLASH2_SLIDING_WINDOW)
    return dataclasses.replace(
        c,
        step_tokens=c.step_tokens or 4 * c.token_budget,
        max_length=c.max_length or c.token_budget,
        gamma=c.gamma or GAMMA_BY_BLOCK_SIZE[c.block_size],
        muon_lr=(c.muon_lr or 10 * c.lr) if c.optimizer == "muon" else 0.0,
    )


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
    kind = _kind(f)
    if kind == "list":
        return _list_parser(f, where)(value)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise UserError(f"{where} must be true or false, got {value!r}")
    if kind == "str":
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
    except (TypeError, ValueError, OverflowError):
        raise UserError(f"{where} must be {'an integer' if kind == 'int' else 'a number'}, got {value!r}") from None


_CHOICES = {"order": ORDERS, "layout": LAYOUTS, "schedule": ("cosine", "linear", "constant"),
            "dtype": ("auto", "bf16", "fp32"), "attention_backend": ATTENTION_BACKENDS,
            "target_partition": TARGET_PARTITIONS, "drafter_kind": DRAFTER_KINDS, "optimizer": OPTIMIZERS}
_AT_LEAST_ONE = ("token_budget", "epochs", "num_anchors", "block_size", "draft_layers", "buckets", "packing_window",
                 "keep_checkpoints", "log_every", "num_target_features", "max_nonfinite_steps")
_NON_NEGATIVE = ("step_tokens", "max_steps", "stop_at_step", "max_length", "num_workers", "eval_every",
                 "checkpoint_every", "seed", "row_budget", "subset_tokens", "eval_sample_turns")
_FINITE = ("lr", "muon_lr", "muon_momentum", "weight_decay", "grad_clip", "gamma", "warmup_ratio", "eval_fraction",
           "memory_gib", "selector_weight", "dpace_alpha", "distill_temperature", "feature_noise")
# option: (holds, what it must be), checked once the value is a finite number
_RANGES = {
    "block_size": (lambda v: v >= 2, "must be >= 2 (slot 0 holds the anchor)"),
    "gamma": (lambda v: v >= 0, "must be positive (0: the default for the block size)"),
    "warmup_ratio": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "eval_fraction": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "lr": (lambda v: v > 0, "must be positive"),
    "muon_lr": (lambda v: v >= 0, "must be >= 0 (0: 10 x --lr)"),
    "muon_momentum": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "weight_decay": (lambda v: v >= 0, "must be >= 0"),
    "grad_clip": (lambda v: v >= 0, "must be >= 0 (0: no clipping)"),
    "dpace_alpha": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "distill_temperature": (lambda v: v > 0, "must be > 0"),
    "feature_noise": (lambda v: v >= 0, "must be >= 0 (0: none)"),
    "memory_gib": (lambda v: v >= 0, "must be >= 0 (0: the GPU's own)"),
    "selector_weight": (lambda v: v >= 0, "must be >= 0"),
    "speculate_turns": (lambda v: v >= -1, "must be >= 0, or -1 (one per optimizer step)"),
    "eval_temperatures": (lambda v: all(math.isfinite(t) for t in v), "must be finite numbers >= 0"),
}


def _bad(name: str, why: str):
    raise UserError(f"{_flag(name)}: {why}")


def validate(c: TrainConfig) -> None:
    """Every option on its own (choices, ranges), then the options that depend on each other."""
    for name, choices in _CHOICES.items():
        if getattr(c, name) not in choices:
            _bad(name, f"must be one of {', '.join(choices)}, got {getattr(c, name)!r}")
    for names, holds, why in ((_AT_LEAST_ONE, lambda v: v >= 1, "must be >= 1"),
                              (_NON_NEGATIVE, lambda v: v >= 0, "must be >= 0"),
                              (_FINITE, math.isfinite, "must be a finite number")):
        for name in names:
            if not holds(getattr(c, name)):
                _bad(name, f"{why}, got {getattr(c, name)}")
    for name, (holds, why) in _RANGES.items():
        if not holds(getattr(c, name)):
            _bad(name, f"{why}, got {getattr(c, name)}")
    _validate_relations(c)


def _validate_relations(c: TrainConfig) -> None:
    from dflash.models.terms import parse_recipe

    try:
        parse_recipe(c.loss)
    except ValueError as e:
        _bad("loss", str(e))
    if 0 < c.row_budget < c.block_size * c.num_anchors:
        _bad("row_budget", f"must be 0 or at least block size x anchors ({c.block_size * c.num_anchors}) so that "
                           f"every sample fits, got {c.row_budget}")
    if c.cost_model:
        from dflash.data.cost import CostModel

        try:
            CostModel.load(c.cost_model)  # read again by the trainer; checked here before anything loads
        except UserError as e:
            _bad("cost_model", str(e))
    if c.gamma == 0 and c.block_size not in GAMMA_BY_BLOCK_SIZE:
        _bad("gamma", f"no default for block size {c.block_size}; give --gamma")
    if c.target_offload and c.target_partition != "zero3":
        _bad("target_offload", "offloads the partitions of --target-partition zero3; add it, or drop --target-offload")
    _validate_synthetic(c)
    if c.drafter_layer_types is not None and len(c.drafter_layer_types) != c.draft_layers:
        _bad("drafter_layer_types", f"gives {len(c.drafter_layer_types)} types for {c.draft_layers} drafter layers "
                                    "(--draft-layers): one per layer")
    sliding = (c.drafter_layer_types is not None and SLIDING in map(layer_type, c.drafter_layer_types)) or (
        c.drafter_kind == "dflash2" and c.drafter_layer_types is None)  # the released layers (`resolve`)
    if sliding and c.sliding_window < 1 and c.drafter_layer_types is not None:
        _bad("sliding_window", "sliding drafter layers need a window >= 1 (positions seen, the query's own included)")
    if not sliding and c.sliding_window:
        _bad("sliding_window", "no drafter layer is sliding (--drafter-layer-types)")
    if c.optimizer == "muon" and c.grad_clip > 0:
        _bad("grad_clip", f"must be 0 with --optimizer muon ({MUON_NO_CLIP}), got {c.grad_clip}")
    if c.optimizer != "muon" and (c.muon_lr != 0 or c.muon_momentum != TrainConfig.muon_momentum):
        _bad("muon_lr" if c.muon_lr != 0 else "muon_momentum", "applies to --optimizer muon")
    if c.force_resume and not c.resume:
        _bad("force_resume", "only makes sense with --resume")
    if c.overwrite and c.resume:
        _bad("overwrite", "contradicts --resume: continue the run (--resume) or start it over (--overwrite)")


def _validate_synthetic(c: TrainConfig) -> None:
    """A random target's shape is known before anything loads, and it has no text to tokenize data with."""
    from dflash.data.synthetic import is_synthetic, parse_samples
    from dflash.models.target_spec import is_random_target, load_target_spec

    if is_synthetic(c.data):
        parse_samples(c.data)
        if c.messages_field:
            _bad("messages_field", f"names a column of conversations; --data {c.data} makes synthetic token ids")
    if is_random_target(c.target):
        load_target_spec(c.target)
        if c.target_partition != "none":
            _bad("target_partition", f"--target {c.target} is built whole in memory; a model folder's checkpoint "
                                     "loads into partitions")
        if not is_synthetic(c.data):
            _bad("data", f"--target {c.target} has random weights and a synthetic tokenizer (no text): train it on "
                         f"--data random or random:SAMPLES, got {c.data}")
