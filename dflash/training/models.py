"""The models part: the frozen target (loaded once, shareable), the drafter sized from it, and the
DeepSpeed engine that trains the drafter, built from the `loss` and `optim` sections and the run
plan's `ModelSettings`."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from dflash.distributed.ranks import on_rank0
from dflash.drafter.kinds import DrafterKind, drafter_kind
from dflash.errors import NonFiniteWeights, UserError
from dflash.target.spec import TargetSpec
from dflash.training.config.sections import Device, Drafter, Loss, Optim
from dflash.training.target import LoadedTarget, load_target


def load_train_target(spec: TargetSpec, device, dtype, drafter: Drafter, placement: Device,
                      chat_data: str | None, features: tuple[str, str] | None = None) -> LoadedTarget:
    """The run's target, tapped and placed as the `drafter` and `device` sections say (`chat_data`: the
    conversations its chat template renders, `data.chat_data`; `features`: a feature store and the token
    store it was captured from, read instead of the target's weights); with --init-drafter, the mask token
    id is the drafter's (what the engines feed its mask slots: nothing is added to the tokenizer), checked
    against the embedding's rows."""
    d = drafter
    target = load_target(spec, device, dtype, target_layer_ids=d.target_layer_ids,
                         num_features=d.num_target_features, attention_backend=placement.attention_backend,
                         mask_token=not d.init_drafter, mask_text=d.mask_token, chat_data=chat_data,
                         partition=placement.target_partition, offload=placement.target_offload,
                         features=features)
    if not d.init_drafter:
        return target
    from dflash.drafter.config import check_fits_target
    from dflash.training.config import init_drafter_config

    config = init_drafter_config(d.init_drafter, spec)
    try:  # its layer count was checked with the options; now against the embedding's rows
        check_fits_target(config, target.hf.config, target.model.num_embedding_rows, num_target_layers_given=False)
    except ValueError as e:
        raise UserError(f"--init-drafter {d.init_drafter} does not fit --target {spec.name}: {e}") from None
    return target._replace(mask_id=config.mask_token_id)


def lr_lambda(schedule: str, warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        if schedule == "linear":
            return 1 - progress
        return 1.0

    return f


def init_drafter(folder: str, target: LoadedTarget, options: dict):
    """The DFlashDrafter of --init-drafter `folder` with its weights, in fp32 (DeepSpeed casts to the
    run's dtype) and lent the target's embedding; the optimizer starts fresh. Its options (block
    size, taps, layer types, mask token) were taken by `config.load_config` / `load_train_target`."""
    import dataclasses

    from dflash.drafter.network import DFlashDrafter

    drafter = DFlashDrafter.from_pretrained(folder, **options).float()  # the network of the folder's kind
    if drafter.config.target_layer_ids != list(target.model.target_layer_ids):
        raise UserError(f"--init-drafter {folder}: taps {drafter.config.target_layer_ids}, but the target is tapped "
                        f"at {list(target.model.target_layer_ids)}")
    # Exported with the target's layer count also when the drafter's config.json left it out.
    layers = target.hf.config.get_text_config().num_hidden_layers
    drafter.config = dataclasses.replace(drafter.config, num_target_layers=layers)
    drafter.attach(target.model.shared_weights())
    return drafter


def new_drafter(target: LoadedTarget, kind, kind_settings, *, block_size: int, draft_layers: int, layer_types,
                sliding_window: int, **options):
    """A new drafter of `kind` (by name or resolved) with `kind_settings` (None: as released) on `target`,
    lent its embedding; `options` go to the network (attention_backend, activation_checkpointing)."""
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.network import drafter_class

    config = DrafterConfig.from_target(target.hf.config, mask_token_id=target.mask_id, block_size=block_size,
                                       draft_layers=draft_layers, target_layer_ids=target.model.target_layer_ids,
                                       vocab_size=target.model.num_embedding_rows, layer_types=layer_types,
                                       sliding_window=sliding_window or None,
                                       **drafter_kind_settings(kind, kind_settings))
    return drafter_class(config)(config, target.model.shared_weights(), **options)


def drafter_kind_settings(kind: str | DrafterKind, settings=None) -> dict:
    """`DrafterConfig.from_target` arguments of a new drafter of `kind` (by name, or the run's
    resolved kind) with its `settings` (`RunPlan.kind_settings`; None: the kind's released ones), its
    layers' causality as released."""
    kind = drafter_kind(kind) if isinstance(kind, str) else kind
    settings = kind.released_settings() if settings is None else settings
    return {"kind": kind.name, "kind_settings": settings, "is_causal": kind.released_is_causal}


def training_loss(loss: Loss, block_size: int, drafter, *, recipe: bool = True, terms: dict | None = None,
                  kind: DrafterKind | None = None):
    """The objective of `drafter`: with `recipe`, --loss's ce_weight x the cross-entropy plus its terms
    (dflash.objective.terms), else the cross-entropy alone (what held-out runs are compared by); and its
    kind's own terms and logit map (`DrafterKind.terms`, `logit_map`). Chunks of whole blocks when a
    term weighs blocks (D-PACE). A run passes its resolved `terms` and `kind` (`ResolvedRun`); a loss
    built outside a run parses --loss and looks the drafter's kind up here."""
    from dflash.objective.loss import BlockLoss
    from dflash.objective.terms import build_terms, chunk_rows_for, parse_recipe

    if not recipe:
        weights = {"ce": 1.0}
    else:
        weights = parse_recipe(loss.loss) if terms is None else terms
    kind = drafter_kind(drafter.config.kind) if kind is None else kind
    terms = build_terms(weights, loss, lm_head=drafter.lm_head)
    scale, softcap = kind.logit_map(drafter.config)
    return BlockLoss(chunk_rows_for(weights, block_size), ce_weight=weights.get("ce", 0.0),
                     terms=[*terms, *kind.terms(drafter, loss)], logit_scale=scale, softcap=softcap)


def engine_for(module: torch.nn.Module, ds_config: dict, optim: Optim, total_steps: int, device):
    """`(engine, optimizer, scheduler)`: DeepSpeed's engine training `module` with the optimizer of
    the options (AdamW, DeepSpeed's CPU Adam where the config offloads it, or the config's own
    optimizer section: Muon, `ds_config.with_optimizer`) and the learning-rate schedule over
    `total_steps`, which scales every parameter group's rate alike."""
    import deepspeed

    from dflash.training.ds_config import muon_split, offloads_optimizer

    params = list(module.parameters())
    warmup = int(optim.warmup_ratio * total_steps)

    def schedule(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim.schedule, warmup, total_steps))

    if "optimizer" in ds_config:  # DeepSpeed builds it: scheduled once it exists
        optimizer = None
        if ds_config["optimizer"].get("type") == "Muon" and torch.device(device).type == "cpu":
            # DeepSpeed's Muon step is torch.compile'd: on CPU ranks inductor would build it at every
            # start (16 s of a 36-s 2-rank launch on 2 cores) for the same arithmetic, unfused; a CPU
            # run compiles nothing else unless --attention-backend flex, so dynamo is off for the process
            torch._dynamo.config.disable = True
            # its AdamW half torch's, the same update: DeepSpeed's default there, FusedAdam, is a C++ op a CPU
            # rank builds at its first use (minutes of compiling on 2 cores, ninja in ~/.cache/torch_extensions)
            section = ds_config["optimizer"]
            ds_config = {**ds_config, "optimizer": {**section, "params": {**section.get("params", {}),
                                                                          "torch_adam": True}}}
    elif offloads_optimizer(ds_config):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(params, lr=optim.lr, weight_decay=optim.weight_decay, adamw_mode=True)
    else:
        optimizer = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay,
                                      fused=torch.device(device).type == "cuda" or None)
    with muon_split(module):  # the drafter's lookup tables and non-matrix kernels on AdamW
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=module, optimizer=optimizer, model_parameters=params, config=ds_config,
            lr_scheduler=schedule if optimizer is None else schedule(optimizer))
    return engine, optimizer, scheduler


class Models:
    """The target (features only), the drafter and the DeepSpeed engine, optimizer and schedule
    that train it over `total_steps` steps.

    Attributes: `target` (LoadedTarget), `drafter` (the module), `engine` (DeepSpeed's wrapper:
    call it for the forward: hidden states), `loss` (`BlockLoss`: hidden states -> loss and metrics),
    `optimizer`, `scheduler`, `zero_stage`.
    """

    def __init__(self, settings, loss: Loss, optim: Optim, target: LoadedTarget, ds_config: dict, *,
                 total_steps: int, device):
        """`settings`: the run plan's `ModelSettings` (the drafter to build)."""
        from dflash.training.ds_config import zero_stage

        self.target = target
        s = settings
        torch.manual_seed(s.seed)  # after the target: the drafter's init must not depend on who loaded it
        options = dict(attention_backend=s.attention_backend, activation_checkpointing=s.activation_checkpointing)
        if s.init_drafter:
            self.drafter = init_drafter(s.init_drafter, target, options)
        else:
            self.drafter = new_drafter(target, s.kind, s.kind_settings, block_size=s.block_size,
                                       draft_layers=s.draft_layers, layer_types=s.drafter_layer_types,
                                       sliding_window=s.sliding_window, **options)
        # the objective: hidden states + blocks -> loss sum and metrics; held out: what recipes are compared by
        self.loss = training_loss(loss, s.block_size, self.drafter, terms=s.terms, kind=s.kind)
        self.eval_loss = training_loss(loss, s.block_size, self.drafter, recipe=False, kind=s.kind)
        self.zero_stage = zero_stage(ds_config)
        self.engine, self.optimizer, self.scheduler = engine_for(self.drafter, ds_config, optim, total_steps, device)

    def export(self, directory: Path, target: dict | None = None) -> None:
        """The drafter in the official DFlash format (parameters gathered under ZeRO-3; rank 0 writes),
        with `target`, the record of the target it was trained on (`save_pretrained`)."""
        import deepspeed

        params = list(self.drafter.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=self.zero_stage == 3):
            try:
                on_rank0(lambda: self.drafter.save_pretrained(directory, target), "exporting the drafter")
            except NonFiniteWeights as e:
                advice = "the training diverged: lower --lr, or resume from an earlier checkpoint"
                raise UserError(f"{e}: {advice}") from None
