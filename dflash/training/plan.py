"""What a run decides before anything loads, from its options and its target's config alone:
`plan_run` -> `RunPlan` (the DeepSpeed config, the precision, the memory plan and the row budget
that fits, a DFlash2 drafter's sizes, the drafter settings a resume must match). Pure: it reads
the DeepSpeed JSON and an --init-drafter's config, loads no weights, talks to no rank; a run that
cannot fit is refused here."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.errors import UserError
from dflash.models.config import DFlash2Settings
from dflash.models.target_spec import TargetSpec
from dflash.sizing.fit import accelerator_memory, size_run
from dflash.sizing.memory import MemoryPlan, MemorySetup, plan_for
from dflash.training.config import TrainConfig, init_drafter_config
from dflash.training.ds_config import training_ds_config, with_optimizer


@dataclass(frozen=True)
class RunPlan:
    cfg: TrainConfig  # with the row budget that fits filled in
    ds_config: dict  # the user's DeepSpeed JSON, "auto" values filled, the optimizer section of --optimizer
    dtype: torch.dtype
    memory: MemoryPlan
    memory_line: str  # what the plan says of the run, for the log
    dflash2: DFlash2Settings | None  # a DFlash2 drafter's sizes (`drafter_dflash2`), None for DFlash
    drafter_settings: dict  # what shapes the drafter's weights, the target's fingerprint among them


def plan_run(cfg: TrainConfig, spec: TargetSpec, *, device: torch.device, world_size: int) -> RunPlan:
    """The plan of the run `cfg` on `world_size` ranks of `device`s (raises UserError, naming the
    option, for a DeepSpeed config or a run that cannot be)."""
    ds_config, dtype = training_ds_config(cfg.device.deepspeed_config, cfg.device.dtype, device=device,
                                          world_size=world_size, grad_clip=cfg.optim.grad_clip)
    o = cfg.optim
    ds_config = with_optimizer(ds_config, o.optimizer, lr=o.lr, muon_lr=o.muon_lr, momentum=o.muon_momentum,
                               weight_decay=o.weight_decay, named=f"--deepspeed_config {cfg.device.deepspeed_config}")
    dflash2 = drafter_dflash2(cfg, spec)
    memory = memory_plan(cfg, spec, ds_config, dtype_bytes=dtype.itemsize, world_size=world_size, device=device,
                         dflash2=dflash2)
    row_budget, memory_line = size_run(memory, accelerator_memory(device, cfg.device.memory_gib),
                                       token_budget=cfg.batches.token_budget, row_budget=cfg.batches.row_budget,
                                       longest=longest_sample(cfg))
    cfg = cfg.replace(row_budget=row_budget)
    settings = {**drafter_settings(cfg, spec.num_layers), "--target": spec.fingerprint()}
    return RunPlan(cfg, ds_config, dtype, memory, memory_line, dflash2, settings)


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


def drafter_dflash2(cfg: TrainConfig, spec: TargetSpec) -> DFlash2Settings | None:
    """The DFlash2 settings of the drafter the run trains (None: a DFlash drafter): an --init-drafter's
    own (its selector and convolutions sized as it was), else the released sizes for --drafter-kind dflash2."""
    if cfg.drafter.init_drafter:
        return init_drafter_config(cfg.drafter.init_drafter, spec).dflash2
    if cfg.drafter.drafter_kind == "dflash2":
        from dflash.models.dflash2 import released_settings

        settings = released_settings()
        try:  # the released sizes against this target, before it loads (no flag sets them: the kind does)
            settings.check(spec.hidden_size, spec.embedding_rows)
        except ValueError as e:
            raise UserError(f"--drafter-kind dflash2: its released sizes do not fit --target {spec.name}: "
                            f"{str(e).replace('dflash_config.', '')}; train --drafter-kind dflash on this target, "
                            "or start from a DFlash2 drafter sized for it (--init-drafter)") from None
        return settings
    return None


def memory_plan(cfg: TrainConfig, spec: TargetSpec, ds_config: dict, *, dtype_bytes: int, world_size: int,
                device, dflash2: DFlash2Settings | None) -> MemoryPlan:
    """The memory plan of the run `cfg` on the target `spec` and `device`, from its config alone
    (`dflash2`: `drafter_dflash2`)."""
    from dflash.ops.common.backend import resolve_backend

    d, dev = cfg.drafter, cfg.device
    features = len(d.target_layer_ids) if d.target_layer_ids else d.num_target_features
    reference = resolve_backend(dev.attention_backend, torch.device(device), op="block") == "torch"
    setup = MemorySetup.from_ds_config(
        ds_config, world_size=world_size, dtype_bytes=dtype_bytes, target_partition=dev.target_partition,
        target_offload=dev.target_offload, activation_checkpointing=dev.activation_checkpointing,
        block_size=d.block_size, num_anchors=d.num_anchors, attention="reference" if reference else "kernel",
        **loss_setup(cfg, device))
    return plan_for(spec, setup, draft_layers=d.draft_layers, features=features, dflash2=dflash2)


def loss_setup(cfg: TrainConfig, device=None) -> dict:
    """The objective's share of the plan from the options alone (the run's `BlockLoss` is built later,
    with the drafter): `training_loss`'s chunk rows and vocab buffers (`chunk_vocab_buffers`), and
    whether a term reads the target's final states. A DFlash2 drafter is counted with a softcap (a
    released one may have it: the plan must not be low); on `device` CUDA with no term besides its
    selector, it runs the fused head (`loss.fused_head`): the chunk's logits in the compute dtype alone."""
    from dflash.models.loss import chunk_vocab_buffers
    from dflash.models.terms import TERMS, chunk_rows_for, parse_recipe
    from dflash.ops.common.backend import HAS_TRITON

    weights = parse_recipe(cfg.loss.loss)
    terms = [TERMS[name] for name, weight in weights.items() if name != "ce" and weight]
    dflash2 = cfg.drafter.drafter_kind == "dflash2"
    fused = dflash2 and not terms and device is not None and torch.device(device).type == "cuda" and HAS_TRITON
    return {"vocab_buffers": 0 if fused else chunk_vocab_buffers([t.vocab_buffers for t in terms], dflash2),
            "chunk_rows": chunk_rows_for(weights, cfg.drafter.block_size),
            "target_states": any(getattr(t, "needs_target_states", False) for t in terms)}


def drafter_settings(cfg: TrainConfig, num_target_layers: int | None) -> dict:
    """What shapes the drafter's weights and what they learn, by option, as a checkpoint records it
    and `--resume` compares it (with the target, `TargetSpec.fingerprint`): the taps (resolved by the
    official rule for a target of `num_target_layers` when not given), the drafter's size, block,
    anchors, loss decay and mask token."""
    from dflash.data.vocab import MASK_TOKEN
    from dflash.models.taps import default_target_layer_ids
    from dflash.models.terms import parse_recipe

    types = list(cfg.drafter.drafter_layer_types or [])
    recipe = {name: weight for name, weight in sorted(parse_recipe(cfg.loss.loss).items()) if weight}
    # every value as resolved, defaults included (a checkpoint without one is compared through the
    # options it recorded: `Checkpointer.claim`)
    settings = {"--drafter-kind": cfg.drafter.drafter_kind, "--optimizer": cfg.optim.optimizer,
                "--block-size": cfg.drafter.block_size, "--draft-layers": cfg.drafter.draft_layers,
                "--num-anchors": cfg.drafter.num_anchors, "--gamma": cfg.loss.gamma,
                "--loss": ",".join(f"{name}={weight:g}" for name, weight in recipe.items()),
                # the mask each layer trains with (the weights have the same shapes whatever it is)
                "--drafter-layer-types": ",".join(types) if "sliding_attention" in types else "full",
                "--sliding-window": cfg.drafter.sliding_window, "--feature-noise": cfg.loss.feature_noise}
    if "dpace" in recipe:  # the settings of the parts the objective has
        settings["--dpace-alpha"] = cfg.loss.dpace_alpha
    if {"kl", "lk"} & set(recipe):
        settings["--distill-temperature"] = cfg.loss.distill_temperature
    if cfg.drafter.drafter_kind == "dflash2":
        settings.update({"--selector-weight": cfg.loss.selector_weight,
                         "--selector-stop-grad": cfg.loss.selector_stop_grad})
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
