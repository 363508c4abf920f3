"""Every option checked before anything loads, each error naming the flag: each option on its own
(choices, ranges), then the rules between options of different sections, in one place."""
from __future__ import annotations

import math
from pathlib import Path

from dflash.data.planner import LAYOUTS, ORDERS
from dflash.drafter.config_format import SLIDING
from dflash.drafter.kinds import drafter_kind, kind_names
from dflash.errors import UserError
from dflash.objective.loss import GAMMA_BY_BLOCK_SIZE
from dflash.ops import ATTENTION_BACKENDS
from dflash.training.config.sections import (
    KIND_OPTIONS,
    OPTIMIZERS,
    TARGET_PARTITIONS,
    TERM_OPTIONS,
    TrainConfig,
    default,
    flag,
    layer_type,
)

# DeepSpeed 0.19.8 scales the Muon update (fixed norm: Newton-Schulz) by the clip factor of the raw
# gradient's norm, which shrinks it by orders of magnitude (measured: 1.5e-6 RMS against 7.9e-4 unclipped)
MUON_NO_CLIP = "DeepSpeed clips Muon's orthogonalised update by the raw gradient's norm, shrinking it"

_CHOICES = {"order": ORDERS, "layout": LAYOUTS, "schedule": ("cosine", "linear", "constant"),
            "dtype": ("auto", "bf16", "fp32"), "attention_backend": ATTENTION_BACKENDS,
            "target_partition": TARGET_PARTITIONS, "optimizer": OPTIMIZERS}
_AT_LEAST_ONE = ("token_budget", "epochs", "num_anchors", "block_size", "draft_layers", "buckets", "packing_window",
                 "keep_checkpoints", "log_every", "num_target_features", "max_nonfinite_steps")
_NON_NEGATIVE = ("step_tokens", "max_steps", "stop_at_step", "max_length", "num_workers", "eval_every",
                 "checkpoint_every", "seed", "row_budget", "subset_tokens", "eval_sample_turns")
_FINITE = ("lr", "muon_lr", "muon_momentum", "weight_decay", "grad_clip", "gamma", "warmup_ratio", "eval_fraction",
           "memory_gib", "feature_noise")
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
    "feature_noise": (lambda v: v >= 0, "must be >= 0 (0: none)"),
    # 64 TiB per device: far above any accelerator, and the plan's integers stay exact
    "memory_gib": (lambda v: 0 <= v <= 1 << 16, "must be in [0, 65536] GiB (0: the GPU's own)"),
    "speculate_turns": (lambda v: v >= -1, "must be >= 0, or -1 (one per optimizer step)"),
    "eval_temperatures": (lambda v: all(math.isfinite(t) for t in v), "must be finite numbers >= 0"),
}


def _bad(name: str, why: str):
    raise UserError(f"{flag(name)}: {why}")


def validate(c: TrainConfig) -> None:
    """Every option on its own (choices, ranges), then the options that depend on each other."""
    check_each(c)
    _validate_relations(c)


def check_each(c: TrainConfig, names=None) -> None:
    """Each option of `names` (None: all) on its own: its choices, its range."""
    def named(options):
        return [n for n in options if names is None or n in names]

    choices = {**_CHOICES, "drafter_kind": kind_names()}
    for name in named(choices):
        if c.value(name) not in choices[name]:
            _bad(name, f"must be one of {', '.join(choices[name])}, got {c.value(name)!r}")
    for options, holds, why in ((_AT_LEAST_ONE, lambda v: v >= 1, "must be >= 1"),
                                (_NON_NEGATIVE, lambda v: v >= 0, "must be >= 0"),
                                (_FINITE, math.isfinite, "must be a finite number")):
        for name in named(options):
            if not holds(c.value(name)):
                _bad(name, f"{why}, got {c.value(name)}")
    for name in named(_RANGES):
        holds, why = _RANGES[name]
        if not holds(c.value(name)):
            _bad(name, f"{why}, got {c.value(name)}")
    added = {**TERM_OPTIONS, **KIND_OPTIONS}
    for name in named(added):  # a loss term's options, a drafter kind's own
        value, check = c.value(name), added[name][1].check
        if isinstance(value, float) and not math.isfinite(value):
            _bad(name, f"must be a finite number, got {value}")
        if check is not None and not check[0](value):
            _bad(name, f"{check[1]}, got {value}")


def check_kind_options(c: TrainConfig) -> None:
    """A drafter kind's own options are left at their defaults unless the run trains that kind."""
    kind = drafter_kind(c.drafter.drafter_kind)
    for name, (owner, _) in KIND_OPTIONS.items():
        if owner is not kind and c.value(name) != default(name):
            _bad(name, f"applies to a {owner.title} drafter: give --drafter-kind {owner.name} (or --init-drafter "
                       f"a {owner.title} drafter)")


def _validate_relations(c: TrainConfig) -> None:
    from dflash.objective.terms import parse_recipe

    try:
        parse_recipe(c.loss.loss)
    except ValueError as e:
        _bad("loss", str(e))
    if 0 < c.batches.row_budget < c.drafter.block_size * c.drafter.num_anchors:
        _bad("row_budget", "must be 0 or at least block size x anchors "
                           f"({c.drafter.block_size * c.drafter.num_anchors}) so that "
                           f"every sample fits, got {c.batches.row_budget}")
    if c.batches.cost_model:
        from dflash.data.cost import CostModel

        try:
            CostModel.load(c.batches.cost_model)  # read again by the trainer; checked here before anything loads
        except UserError as e:
            _bad("cost_model", str(e))
    if c.loss.gamma == 0 and c.drafter.block_size not in GAMMA_BY_BLOCK_SIZE:
        _bad("gamma", f"no default for block size {c.drafter.block_size}; give --gamma")
    if c.device.target_offload and c.device.target_partition != "zero3":
        _bad("target_offload", "offloads the partitions of --target-partition zero3; add it, or drop --target-offload")
    _validate_synthetic(c)
    _validate_drafter(c)
    if c.inputs.features:
        _validate_features(c)
    if c.optim.optimizer == "muon" and c.optim.grad_clip > 0:
        _bad("grad_clip", f"must be 0 with --optimizer muon ({MUON_NO_CLIP}), got {c.optim.grad_clip}")
    if c.optim.optimizer != "muon" and (c.optim.muon_lr != 0 or c.optim.muon_momentum != default("muon_momentum")):
        _bad("muon_lr" if c.optim.muon_lr != 0 else "muon_momentum", "applies to --optimizer muon")
    if c.run.force_resume and not c.run.resume:
        _bad("force_resume", "only makes sense with --resume")
    if c.run.overwrite and c.run.resume:
        _bad("overwrite", "contradicts --resume: continue the run (--resume) or start it over (--overwrite)")


def _validate_drafter(c: TrainConfig) -> None:
    """The drafter's layer types and window, and the options only another drafter kind has."""
    if c.drafter.drafter_layer_types is not None and len(c.drafter.drafter_layer_types) != c.drafter.draft_layers:
        _bad("drafter_layer_types", f"gives {len(c.drafter.drafter_layer_types)} types for "
                                    f"{c.drafter.draft_layers} drafter layers "
                                    "(--draft-layers): one per layer")
    types, kind = c.drafter.drafter_layer_types, drafter_kind(c.drafter.drafter_kind)
    sliding = (types is not None and SLIDING in map(layer_type, types)) or (
        kind.released_layer_type == SLIDING and types is None)  # the kind's released layers (`resolve`)
    if sliding and c.drafter.sliding_window < 1 and c.drafter.drafter_layer_types is not None:
        _bad("sliding_window", "sliding drafter layers need a window >= 1 (positions seen, the query's own included)")
    if not sliding and c.drafter.sliding_window:
        _bad("sliding_window", "no drafter layer is sliding (--drafter-layer-types)")
    check_kind_options(c)


def _validate_features(c: TrainConfig) -> None:
    """Captured features stand in for the target's forward, not for its decoding."""
    from dflash.data.sources import is_token_store
    from dflash.target.spec import is_random_target

    if is_random_target(c.inputs.target) or not is_token_store(Path(c.inputs.data)):
        _bad("features", f"reads features captured of a model's token store: give --data the token store it was "
                         f"captured from (launch/capture_features.py prints it), got --target {c.inputs.target} "
                         f"--data {c.inputs.data}")
    for name in ("eval_sample_turns", "speculate_turns"):
        if c.value(name):
            _bad(name, "needs the target to decode, which --features leaves unloaded; give 0")
    if c.device.target_partition != "none":
        _bad("target_partition", "partitions a target's weights, which --features leaves unloaded")


def _validate_synthetic(c: TrainConfig) -> None:
    """A random target's shape is known before anything loads, and it has no text to tokenize data with."""
    from dflash.data.synthetic import is_synthetic, parse_samples
    from dflash.target.spec import load_target_spec, target_folder

    if is_synthetic(c.inputs.data):
        parse_samples(c.inputs.data)
        if c.inputs.messages_field:
            _bad("messages_field", f"names a column of conversations; --data {c.inputs.data} makes synthetic token ids")
    if target_folder(c.inputs.target) is None:  # random:...
        load_target_spec(c.inputs.target)
        if c.device.target_partition != "none":
            _bad("target_partition", f"--target {c.inputs.target} is built whole in memory; a model folder's "
                                     "checkpoint "
                                     "loads into partitions")
        if not is_synthetic(c.inputs.data):
            _bad("data", f"--target {c.inputs.target} has random weights and a synthetic tokenizer (no text): "
                         "train it on "
                         f"--data random or random:SAMPLES, got {c.inputs.data}")
