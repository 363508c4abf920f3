"""What a run decides before anything loads, from its options and its target's config alone:
`resolve_run` -> `ResolvedRun` (the options resolved once: the target's spec, the drafter kind,
the terms of --loss), then `plan_run` -> `RunPlan` (those, the DeepSpeed config, the precision, the
memory plan and the row budget that fits, the drafter kind's settings and what they add per row, the
drafter settings a resume must match). Pure: it reads the DeepSpeed JSON and an --init-drafter's
config, loads no weights, talks to no rank; a run that cannot fit is refused here."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.drafter.kinds import DEFAULT, DrafterKind, drafter_kind
from dflash.errors import UserError
from dflash.sizing.fit import accelerator_memory, size_run
from dflash.sizing.memory import MemoryPlan, MemorySetup, plan_for
from dflash.target.spec import TargetSpec, load_target_spec
from dflash.training.config import TrainConfig, init_drafter_config
from dflash.training.ds_config import training_ds_config, with_optimizer


@dataclass(frozen=True)
class ResolvedRun:
    """The run's options resolved once, for the parts to take their piece of: the target's spec (its
    config, before any weight loads), the drafter kind, and --loss parsed into term -> weight."""

    cfg: TrainConfig
    spec: TargetSpec
    kind: DrafterKind
    terms: dict[str, float]


def resolve_run(cfg: TrainConfig, spec: TargetSpec | None = None) -> ResolvedRun:
    """`cfg` (checked: `config.load_config`) resolved: its --target's spec (`spec` where the caller
    has it already), its --drafter-kind and its --loss."""
    from dflash.objective.terms import parse_recipe

    return ResolvedRun(cfg, spec or load_target_spec(cfg.inputs.target), drafter_kind(cfg.drafter.drafter_kind),
                       parse_recipe(cfg.loss.loss))


@dataclass(frozen=True)
class DataSettings:
    """What the training-data part reads beyond its sections (`inputs`, `batches`), resolved."""

    block_size: int
    num_anchors: int
    draft_layers: int
    gamma: float
    seed: int
    epochs: int
    max_steps: int
    extra_row_flops: float  # what the drafter kind adds per block row (`DrafterKind.row_flops`)


@dataclass(frozen=True)
class ModelSettings:
    """What the models part reads beyond its sections (`loss`, `optim`): the drafter it builds."""

    seed: int
    block_size: int
    draft_layers: int
    drafter_layer_types: tuple[str, ...] | None
    sliding_window: int
    kind: DrafterKind
    kind_settings: Any  # the kind's own settings (an --init-drafter's, else as released; None: none)
    init_drafter: str
    attention_backend: str
    activation_checkpointing: bool
    terms: dict[str, float]  # --loss parsed (`ResolvedRun.terms`)


@dataclass(frozen=True)
class EvalSettings:
    """What the evaluator reads beyond its section (`eval`)."""

    block_size: int
    token_budget: int
    seed: int
    target: str  # --target as given: sampled turns' fingerprint
    partitioned: bool  # the target is partitioned across the ranks (no rank decodes alone)
    output_dir: Path
    progress: bool


@dataclass(frozen=True)
class RunPlan:
    cfg: TrainConfig  # with the row budget that fits filled in
    spec: TargetSpec  # the resolved run's (`ResolvedRun`)
    kind: DrafterKind
    terms: dict[str, float]
    ds_config: dict  # the user's DeepSpeed JSON, "auto" values filled, the optimizer section of --optimizer
    dtype: torch.dtype
    memory: MemoryPlan
    memory_line: str  # what the plan says of the run, for the log
    kind_settings: Any  # the drafter kind's own settings (`kind_settings`; None: none)
    extra_row_flops: float  # FLOPs per block row the kind adds in training (`DrafterKind.row_flops`)
    drafter_settings: dict  # what shapes the drafter's weights (the target's identity is added on rank 0)

    @property
    def data(self) -> DataSettings:
        c = self.cfg
        return DataSettings(c.drafter.block_size, c.drafter.num_anchors, c.drafter.draft_layers, c.loss.gamma,
                            c.run.seed, c.optim.epochs, c.optim.max_steps, self.extra_row_flops)

    @property
    def models(self) -> ModelSettings:
        d, dev = self.cfg.drafter, self.cfg.device
        return ModelSettings(self.cfg.run.seed, d.block_size, d.draft_layers, d.drafter_layer_types, d.sliding_window,
                             self.kind, self.kind_settings, d.init_drafter, dev.attention_backend,
                             dev.activation_checkpointing, self.terms)

    @property
    def evaluation(self) -> EvalSettings:
        c = self.cfg
        return EvalSettings(c.drafter.block_size, c.batches.token_budget, c.run.seed, c.inputs.target,
                            c.device.target_partition != "none", Path(c.run.output_dir), c.run.progress)


def plan_run(run: ResolvedRun, *, device: torch.device, world_size: int) -> RunPlan:
    """The plan of the resolved run on `world_size` ranks of `device`s (raises UserError, naming the
    option, for a DeepSpeed config or a run that cannot be)."""
    cfg, spec = run.cfg, run.spec
    spec.layer_ids(cfg.drafter.target_layer_ids, cfg.drafter.num_target_features)  # the taps the config allows
    ds_config, dtype = training_ds_config(cfg.device.deepspeed_config, cfg.device.dtype, device=device,
                                          world_size=world_size, grad_clip=cfg.optim.grad_clip)
    o = cfg.optim
    ds_config = with_optimizer(ds_config, o.optimizer, lr=o.lr, muon_lr=o.muon_lr, momentum=o.muon_momentum,
                               weight_decay=o.weight_decay, named=f"--deepspeed_config {cfg.device.deepspeed_config}")
    settings = kind_settings(run)
    memory = memory_plan(run, ds_config, dtype_bytes=dtype.itemsize, world_size=world_size, device=device,
                         kind_settings=settings)
    row_budget, memory_line = size_run(memory, accelerator_memory(device, cfg.device.memory_gib),
                                       token_budget=cfg.batches.token_budget, row_budget=cfg.batches.row_budget,
                                       longest=longest_sample(cfg))
    cfg = cfg.replace(row_budget=row_budget)
    extra_flops = run.kind.row_flops(spec.config.hidden_size, cfg.drafter.draft_layers, cfg.drafter.block_size,
                                     settings, cfg.loss, vocab=int(spec.config.vocab_size))
    return RunPlan(cfg, spec, run.kind, run.terms, ds_config, dtype, memory, memory_line, settings, extra_flops,
                   drafter_settings(run, spec.num_layers))


def longest_sample(cfg: TrainConfig) -> int | None:
    """The longest sample the run trains on, where known before anything loads: a prepared store's
    (its meta), conversations cut to --max-length; None where they are cut to the token budget."""
    from pathlib import Path

    from dflash.data.sources import is_token_store
    from dflash.data.synthetic import is_synthetic
    from dflash.data.token_store import read_store_meta

    if is_synthetic(cfg.inputs.data) or not is_token_store(Path(cfg.inputs.data)):
        return cfg.inputs.max_length or None
    stats = ((read_store_meta(Path(cfg.inputs.data)) or {}).get("summary") or {}).get("length_stats") or {}
    return stats.get("max")


def kind_settings(run: ResolvedRun) -> Any:
    """The drafter kind's settings of the drafter the run trains: an --init-drafter's own (sized as it
    was), else the kind's released ones."""
    cfg, spec, kind = run.cfg, run.spec, run.kind
    if cfg.drafter.init_drafter:
        return init_drafter_config(cfg.drafter.init_drafter, spec).kind_settings
    settings = kind.released_settings()
    try:  # the released sizes against this target, before it loads (no flag sets them: the kind does)
        kind.check_sizes(settings, spec.hidden_size, spec.embedding_rows)
    except ValueError as e:
        raise UserError(f"--drafter-kind {kind.name}: its released sizes do not fit --target {spec.name}: "
                        f"{str(e).replace('dflash_config.', '')}; train --drafter-kind {DEFAULT} on this target, "
                        f"or start from a {kind.title} drafter sized for it (--init-drafter)") from None
    return settings


def memory_plan(run: ResolvedRun, ds_config: dict, *, dtype_bytes: int, world_size: int,
                device, kind_settings: Any = None) -> MemoryPlan:
    """The memory plan of the resolved run on its target and `device`, from its config alone
    (`kind_settings`: `kind_settings`)."""
    from dflash.ops.common.backend import resolve_backend

    d, dev = run.cfg.drafter, run.cfg.device
    features = len(d.target_layer_ids) if d.target_layer_ids else d.num_target_features
    reference = resolve_backend(dev.attention_backend, torch.device(device), op="block") == "torch"
    setup = MemorySetup.from_ds_config(
        ds_config, world_size=world_size, dtype_bytes=dtype_bytes, target_partition=dev.target_partition,
        target_offload=dev.target_offload, activation_checkpointing=dev.activation_checkpointing,
        block_size=d.block_size, num_anchors=d.num_anchors, attention="reference" if reference else "kernel",
        **loss_setup(run, device))
    return plan_for(run.spec, setup, draft_layers=d.draft_layers, features=features, kind=run.kind.name,
                    kind_settings=kind_settings)


def loss_setup(run: ResolvedRun, device=None) -> dict:
    """The objective's share of the plan from the options alone (the run's `BlockLoss` is built later,
    with the drafter): `training_loss`'s chunk rows and vocab buffers (`chunk_vocab_buffers`), and
    whether a term reads the target's final states. A kind whose logits may pass a softcap is counted
    with one (`DrafterKind.may_softcap`: the plan must not be low); on `device` CUDA, a kind whose own
    terms run the fused head (`DrafterKind.fused_head`) with no other term keeps the chunk's logits in
    the compute dtype alone (`loss.fused_head`)."""
    from dflash.objective.loss import chunk_vocab_buffers
    from dflash.objective.terms import TERMS, chunk_rows_for
    from dflash.ops.common.backend import HAS_TRITON

    weights, kind = run.terms, run.kind
    terms = [TERMS[name] for name, weight in weights.items() if name != "ce" and weight]
    fused = kind.fused_head and not terms and device is not None and torch.device(device).type == "cuda" and HAS_TRITON
    kind_buffers, kind_states = kind.term_costs(run.cfg.loss)
    return {"vocab_buffers": 0 if fused else chunk_vocab_buffers([t.vocab_buffers for t in terms] + kind_buffers,
                                                                 kind.may_softcap),
            "chunk_rows": chunk_rows_for(weights, run.cfg.drafter.block_size),
            "target_states": kind_states or any(getattr(t, "needs_target_states", False) for t in terms)}


def drafter_settings(run: ResolvedRun, num_target_layers: int | None) -> dict:
    """What shapes the drafter's weights and what they learn, by option, as a checkpoint records it
    and `--resume` compares it (with the target's identity, `TargetSpec.fingerprint`, which rank 0
    adds: it hashes the weights): the taps (resolved by the
    official rule for a target of `num_target_layers` when not given), the drafter's size, block,
    anchors, loss decay and mask token."""
    from dflash.data.vocab import MASK_TOKEN
    from dflash.objective.terms import TERMS
    from dflash.target.taps import default_target_layer_ids

    cfg = run.cfg
    types = list(cfg.drafter.drafter_layer_types or [])
    recipe = {name: weight for name, weight in sorted(run.terms.items()) if weight}
    # every value as resolved, defaults included (a checkpoint without one is compared through the
    # options it recorded: `Checkpointer.claim`)
    settings = {"--drafter-kind": cfg.drafter.drafter_kind, "--optimizer": cfg.optim.optimizer,
                "--block-size": cfg.drafter.block_size, "--draft-layers": cfg.drafter.draft_layers,
                "--num-anchors": cfg.drafter.num_anchors, "--gamma": cfg.loss.gamma,
                "--loss": ",".join(f"{name}={weight:g}" for name, weight in recipe.items()),
                # the mask each layer trains with (the weights have the same shapes whatever it is)
                "--drafter-layer-types": ",".join(types) if "sliding_attention" in types else "full",
                "--sliding-window": cfg.drafter.sliding_window, "--feature-noise": cfg.loss.feature_noise}
    # the options of the parts the objective has: its terms' and the kind's
    parts = [name for term in recipe for name in getattr(TERMS.get(term), "options", {})]
    for name in [*parts, *run.kind.options]:
        settings[f"--{name.replace('_', '-')}"] = cfg.value(name)
    if not cfg.drafter.init_drafter:  # the drafter's mask token is its id (compared once the target gives ids)
        settings["--mask-token"] = cfg.drafter.mask_token or MASK_TOKEN
    taps = list(cfg.drafter.target_layer_ids) if cfg.drafter.target_layer_ids else None
    if taps is None and num_target_layers is not None:
        try:
            taps = default_target_layer_ids(num_target_layers, cfg.drafter.num_target_features)
        except ValueError:  # too few layers: loading the target says so
            pass
    if taps is not None:
        settings.update({"--target-layer-ids": taps, "--num-target-features": len(taps)})
    return settings


# What only steers the optimizer through the steps (the weights keep their shapes and objective): a
# resume with another value would equal neither run, so it is refused unless --force-resume.
SCHEDULE = ("lr", "muon_lr", "muon_momentum", "weight_decay", "warmup_ratio", "schedule", "grad_clip", "epochs",
            "max_steps")


def schedule_differences(recorded: dict, cfg: TrainConfig) -> list[str]:
    """`--flag: checkpoint value -> now value` for every `SCHEDULE` option the checkpoint's recorded
    options (its config) hold with another value."""
    from dflash.training.config import flag

    return [f"{flag(name)}: checkpoint {recorded[name]} -> now {cfg.value(name)}" for name in SCHEDULE
            if name in recorded and recorded[name] != cfg.value(name)]
