"""The models part: the frozen target (loaded once, shareable), the drafter sized from it, and the
DeepSpeed engine that trains the drafter, built from a `TrainConfig`."""
from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import torch

from dflash.distributed.ranks import on_rank0
from dflash.errors import NonFiniteWeights, UserError
from dflash.models.target_spec import TargetSpec
from dflash.training.config import TrainConfig
from dflash.training.data import chat_data


class LoadedTarget(NamedTuple):
    """The frozen target and its tokenizer, loaded once; several runs may share one."""

    tokenizer: object
    hf: object  # the Hugging Face model (its config sizes the drafter)
    model: object  # the TargetModel feature extractor
    mask_id: int | None  # the DFlash mask token's id (None: not asked for)
    spec: TargetSpec  # what it was loaded from


def load_target(spec: TargetSpec, device, dtype, *, target_layer_ids=None, num_features: int = 5,
                attention_backend: str = "auto", mask_token: bool = True, mask_text: str = "",
                chat_data: str | None = None, partition: str = "none", offload: bool = False,
                features: tuple[str, str] | None = None) -> LoadedTarget:
    """Tokenizer and frozen target of `spec`: a Hugging Face folder (or `random:PRESET` / `random:PATH`: random
    weights of that shape and a synthetic tokenizer, `dflash.models.random_target`), tapped at
    `target_layer_ids` (default: the official rule with `num_features` taps); with `mask_token`, the
    DFlash mask token (`mask_text`, default MASK_TOKEN) is added to the tokenizer in a spare
    embedding row, or reused if the tokenizer has it. `chat_data`: conversations that will be
    rendered with the tokenizer's chat template, which must then have one. Both are checked before
    a folder's weights load. `partition` "zero3": the target's parameters are partitioned across the
    ranks (`dflash.distributed.partition`; collective, every rank calls this), with `offload` in CPU
    memory; the model is then a `PartitionedTarget`. `features` (a feature store folder, the token store
    it was captured from): the model reads the store (`dflash.features`); the target's weights never load."""
    from transformers import AutoTokenizer

    from dflash.data.tokenizing import check_tokenizer_files
    from dflash.data.vocab import MASK_TOKEN, check_mask_token, ensure_mask_token
    from dflash.models import TargetModel, load_language_model
    from dflash.models.folders import check_target_folder
    from dflash.models.random_target import random_target

    mask_text = mask_text or MASK_TOKEN
    if spec.random:
        target_path = spec.name
        tokenizer, hf = random_target(spec, device, dtype)
    else:
        target_path = spec.folder / spec.gguf_file if spec.gguf_file else spec.folder
        if not spec.gguf_file:  # a .gguf file holds the tokenizer; transformers checks its tensors
            check_target_folder(target_path)  # config.json there, each weight file whole
            check_tokenizer_files(target_path, "--target")
        tokenizer = AutoTokenizer.from_pretrained(str(spec.folder), **spec.load_kwargs)
        if chat_data is not None and not tokenizer.chat_template:
            raise UserError(f"--target {target_path}: its tokenizer has no chat template, which renders the "
                            f"conversations of --data {chat_data}; give the chat (instruct) model's folder, or add "
                            "its template there (chat_template.jinja)")
        try:
            if mask_token:
                check_mask_token(tokenizer, spec.embedding_rows, mask_text)
        except ValueError as e:
            raise UserError(f"--target {target_path}: {e}") from None
        if features:
            from dflash.data.token_store import TokenStore
            from dflash.features import load_captured

            taps = list(target_layer_ids) if target_layer_ids else spec.default_layer_ids(num_features)
            loaded = load_captured(features[0], spec, TokenStore(features[1]), device, dtype, taps, tokenizer)
            mask_id = ensure_mask_token(tokenizer, loaded.model.num_embedding_rows, mask_text) if mask_token else None
            return loaded._replace(mask_id=mask_id)
        if partition == "zero3":
            from dflash.distributed import partition as zero3

            with zero3.zero3_loading(zero3.target_zero3_config(spec, dtype, offload=offload, device=device)):
                hf = load_language_model(spec.folder, dtype, **spec.load_kwargs)  # straight into the partitions
        else:
            # an image-text checkpoint: its language model only
            hf = load_language_model(spec.folder, dtype, device, **spec.load_kwargs)
    try:
        taps = list(target_layer_ids) if target_layer_ids else None
        model = TargetModel(hf, taps, num_features=num_features, attention_backend=attention_backend)
        if partition == "zero3":
            model = zero3.PartitionedTarget(model, zero3.target_zero3_config(spec, dtype, offload=offload,
                                                                             device=device, hf=hf))
        mask_id = ensure_mask_token(tokenizer, model.num_embedding_rows, mask_text) if mask_token else None
    except ValueError as e:
        raise UserError(f"--target {target_path}: {e}") from None
    return LoadedTarget(tokenizer, hf, model, mask_id, spec)


def load_train_target(cfg: TrainConfig, spec: TargetSpec, device, dtype) -> LoadedTarget:
    """The run's target; with --init-drafter, the mask token id is the drafter's (what the engines
    feed its mask slots: nothing is added to the tokenizer), checked against the embedding's rows."""
    target = load_target(spec, device, dtype, target_layer_ids=cfg.drafter.target_layer_ids,
                         num_features=cfg.drafter.num_target_features, attention_backend=cfg.device.attention_backend,
                         mask_token=not cfg.drafter.init_drafter, mask_text=cfg.drafter.mask_token,
                         chat_data=chat_data(cfg),
                         partition=cfg.device.target_partition, offload=cfg.device.target_offload,
                         features=(cfg.inputs.features, cfg.inputs.data) if cfg.inputs.features else None)
    if not cfg.drafter.init_drafter:
        return target
    from dflash.models.config import check_fits_target
    from dflash.training.config import init_drafter_config

    drafter = init_drafter_config(cfg.drafter.init_drafter, spec)
    try:  # its layer count was checked with the options; now against the embedding's rows
        check_fits_target(drafter, target.hf.config, target.model.num_embedding_rows, num_target_layers_given=False)
    except ValueError as e:
        raise UserError(f"--init-drafter {cfg.drafter.init_drafter} does not fit --target {cfg.inputs.target}: "
                        f"{e}") from None
    return target._replace(mask_id=drafter.mask_token_id)


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

    from dflash.models import DFlashDrafter

    drafter = DFlashDrafter.from_pretrained(folder, **options).float()  # a DFlash2 folder: the DFlash2 drafter
    if drafter.config.target_layer_ids != list(target.model.target_layer_ids):
        raise UserError(f"--init-drafter {folder}: taps {drafter.config.target_layer_ids}, but the target is tapped "
                        f"at {list(target.model.target_layer_ids)}")
    # Exported with the target's layer count also when the drafter's config.json left it out.
    layers = target.hf.config.get_text_config().num_hidden_layers
    drafter.config = dataclasses.replace(drafter.config, num_target_layers=layers)
    drafter.attach(target.model.shared_weights())
    return drafter


def drafter_kind_settings(kind: str) -> dict:
    """`DrafterConfig.from_target` arguments of a drafter kind: a DFlash2 drafter sized as released."""
    if kind == "dflash":
        return {}
    from dflash.models.dflash2 import released_settings

    return {"dflash2": released_settings(), "is_causal": False}


def training_loss(cfg: TrainConfig, drafter, *, recipe: bool = True):
    """The objective of `drafter`: with `recipe`, --loss's ce_weight x the cross-entropy plus its terms
    (dflash.models.terms), else the cross-entropy alone (what held-out runs are compared by); for a
    DFlash2 drafter its logits' scale and softcap and its selector's term (--selector-weight,
    --selector-stop-grad). Chunks of whole blocks when a term weighs blocks (D-PACE)."""
    from dflash.models import BlockLoss
    from dflash.models.terms import build_terms, chunk_rows_for, parse_recipe

    weights = parse_recipe(cfg.loss.loss) if recipe else {"ce": 1.0}
    terms = build_terms(weights, lm_head=drafter.lm_head, dpace_alpha=cfg.loss.dpace_alpha,
                        temperature=cfg.loss.distill_temperature)
    chunk_rows = chunk_rows_for(weights, cfg.drafter.block_size)
    s = drafter.config.dflash2
    if s is None:
        return BlockLoss(chunk_rows, ce_weight=weights.get("ce", 0.0), terms=terms)
    from dflash.models.dflash2 import SelectorTerm

    terms = [*terms, SelectorTerm(drafter.candidate_selector, cfg.loss.selector_weight, cfg.loss.selector_stop_grad)]
    return BlockLoss(chunk_rows, ce_weight=weights.get("ce", 0.0), terms=terms,
                     logit_scale=s.output_multiplier, softcap=s.final_logit_softcapping)


def engine_for(module: torch.nn.Module, ds_config: dict, cfg: TrainConfig, total_steps: int, device):
    """`(engine, optimizer, scheduler)`: DeepSpeed's engine training `module` with the optimizer of
    the options (AdamW, DeepSpeed's CPU Adam where the config offloads it, or the config's own
    optimizer section: Muon, `ds_config.with_optimizer`) and the learning-rate schedule over
    `total_steps`, which scales every parameter group's rate alike."""
    import deepspeed

    from dflash.training.ds_config import muon_split, offloads_optimizer

    params = list(module.parameters())
    warmup = int(cfg.optim.warmup_ratio * total_steps)

    def schedule(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim.schedule, warmup, total_steps))

    if "optimizer" in ds_config:  # DeepSpeed builds it: scheduled once it exists
        optimizer = None
        if ds_config["optimizer"].get("type") == "Muon" and torch.device(device).type == "cpu":
            # DeepSpeed's Muon step is torch.compile'd: on CPU ranks inductor would build it at every
            # start (16 s of a 36-s 2-rank launch on 2 cores) for the same arithmetic, unfused; a CPU
            # run compiles nothing else unless --attention-backend flex, so dynamo is off for the process
            torch._dynamo.config.disable = True
    elif offloads_optimizer(ds_config):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, adamw_mode=True)
    else:
        optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
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

    def __init__(self, cfg: TrainConfig, target: LoadedTarget, ds_config: dict, *, total_steps: int, device):
        from dflash.models import DrafterConfig
        from dflash.models.drafter import drafter_class
        from dflash.training.ds_config import zero_stage

        self.target = target
        torch.manual_seed(cfg.run.seed)  # after the target: the drafter's init must not depend on who loaded it
        options = dict(attention_backend=cfg.device.attention_backend,
                       activation_checkpointing=cfg.device.activation_checkpointing)
        if cfg.drafter.init_drafter:
            self.drafter = init_drafter(cfg.drafter.init_drafter, target, options)
        else:
            dcfg = DrafterConfig.from_target(target.hf.config, mask_token_id=target.mask_id,
                                             block_size=cfg.drafter.block_size, draft_layers=cfg.drafter.draft_layers,
                                             target_layer_ids=target.model.target_layer_ids,
                                             vocab_size=target.model.num_embedding_rows,
                                             layer_types=cfg.drafter.drafter_layer_types,
                                             sliding_window=cfg.drafter.sliding_window or None,
                                             **drafter_kind_settings(cfg.drafter.drafter_kind))
            self.drafter = drafter_class(dcfg)(dcfg, target.model.shared_weights(), **options)
        self.loss = training_loss(cfg, self.drafter)  # the objective: hidden states + blocks -> loss sum and metrics
        self.eval_loss = training_loss(cfg, self.drafter, recipe=False)  # held out: what recipes are compared by
        self.zero_stage = zero_stage(ds_config)
        self.engine, self.optimizer, self.scheduler = engine_for(self.drafter, ds_config, cfg, total_steps, device)

    def export(self, directory: Path) -> None:
        """The drafter in the official DFlash format (parameters gathered under ZeRO-3; rank 0 writes)."""
        import deepspeed

        params = list(self.drafter.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=self.zero_stage == 3):
            try:
                on_rank0(lambda: self.drafter.save_pretrained(directory), "exporting the drafter")
            except NonFiniteWeights as e:
                advice = "the training diverged: lower --lr, or resume from an earlier checkpoint"
                raise UserError(f"{e}: {advice}") from None
