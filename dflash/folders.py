"""The folders a command reads, checked before heavy work: one function per kind, naming the file.

A drafter folder (`check_drafter_folder`): config.json and model.safetensors present, the
weights file as long as its header says (a cut copy is named, not a safetensors traceback), its
tensors those the config builds, with their shapes. A target folder (`check_target_folder`):
config.json present, the weight files it loads present (every shard its index names) and whole.
Token stores and checkpoints have their own (`TokenStore` names a damaged store, `COMPLETE` lists
every checkpoint file with its size).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

from dflash.errors import UserError


def safetensors_shapes(path: Path, where: str) -> dict[str, tuple[int, ...]]:
    """name -> shape of the tensors in safetensors file `path`, read from its header; a file that
    is not one, or shorter than its header says (a cut copy), is a UserError naming `where`."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError
            header = json.loads(f.read(length))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        shapes = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise UserError(f"{where}: {path} is not a safetensors file (its header cannot be read)") from None
    need = 8 + length + max(ends, default=0)
    if size < need:
        raise UserError(f"{where}: {path} is cut short ({size:,} of {need:,} bytes); copy it again")
    return shapes


def check_drafter_folder(folder: str | Path, where: str, check_config=None):
    """The DrafterConfig of drafter `folder` (official format), once its files are there, whole
    and consistent: every tensor the config builds, with its shape, and no other (a uniform
    `model.` prefix and a kind's released names are accepted, as `DFlashDrafter.from_pretrained`
    does). `where` names the flag in messages, e.g. `--init-drafter`. `check_config(config, raw)`, when given, runs once
    the config is read and before the weights are (a config that does not fit the target is
    the error to name first)."""
    import torch

    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.network import CONFIG_NAME, WEIGHTS_NAME, drafter_class

    folder = Path(folder)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (folder / name).is_file():
            raise UserError(f"{where} {folder}: no {name} (a drafter folder in the official format holds "
                            f"{CONFIG_NAME} and {WEIGHTS_NAME})")
    try:
        config = DrafterConfig.from_json_dict(json.loads((folder / CONFIG_NAME).read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{where} {folder / CONFIG_NAME}: {e}") from None
    if check_config is not None:
        check_config(config, json.loads((folder / CONFIG_NAME).read_text()))
    cls = drafter_class(config)
    shapes = cls.checkpoint_names(safetensors_shapes(folder / WEIGHTS_NAME, where))
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
    missing, unknown = sorted(expected.keys() - shapes.keys()), sorted(shapes.keys() - expected.keys())
    if missing or unknown:
        raise UserError(f"{where} {folder / WEIGHTS_NAME}: does not hold the drafter its {CONFIG_NAME} describes "
                        f"(missing {missing[:3]}{' ...' if len(missing) > 3 else ''}, unknown "
                        f"{unknown[:3]}{' ...' if len(unknown) > 3 else ''})")
    wrong = [f"{k} is {list(shapes[k])}, the config makes {list(v)}" for k, v in expected.items() if shapes[k] != v]
    if wrong:
        raise UserError(f"{where} {folder / WEIGHTS_NAME}: does not fit its {CONFIG_NAME}: {wrong[0]}"
                        + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""))
    return config


def check_target_folder(folder: str | Path, where: str = "--target") -> None:
    """A target model folder: config.json there, the weight files it loads there (a shard its index
    names among them: `dflash.identity.target_files`), each safetensors file whole."""
    from dflash.identity import target_files

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise UserError(f"{where} {folder}: not a Hugging Face model folder (no config.json)")
    for path in target_files(folder, None, where):
        if path.suffix == ".safetensors":
            safetensors_shapes(path, where)
