"""Loading a frozen target to run: its tokenizer, the Hugging Face model and the `TargetModel` feature
extractor tapped at the drafter's layers, with the DFlash mask token, checked before any weight loads;
what training, decoding (`launch/speculate.py`) and the tools share (`load_target`). It composes the
folder checks, the ZeRO-3 partition and captured features, so it sits above them, in `training`."""
from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

from dflash.errors import UserError
from dflash.target.spec import TargetSpec


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
    weights of that shape and a synthetic tokenizer, `dflash.target.random_weights`), tapped at
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
    from dflash.folders import check_target_folder
    from dflash.target.model import TargetModel, load_language_model
    from dflash.target.random_weights import random_target

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
            model = load_captured(features[0], spec, TokenStore(features[1]), device, dtype, taps)
            mask_id = ensure_mask_token(tokenizer, model.num_embedding_rows, mask_text) if mask_token else None
            # `hf` carries the config only: nothing of the target runs
            return LoadedTarget(tokenizer, SimpleNamespace(config=spec.config), model, mask_id, spec)
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
