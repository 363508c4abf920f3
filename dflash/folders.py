"""The folders a command reads, checked before heavy work: one function per kind, naming the file.

A drafter folder (`check_drafter_folder`): config.json and model.safetensors present, the
weights file as long as its header says (a cut copy is named, not a safetensors traceback), its
tensors those the config builds, with their shapes. A target folder (`check_target_folder`):
config.json present, each safetensors file whole. Token stores and checkpoints have their own
(`TokenStore` names a damaged store, `COMPLETE` lists every checkpoint file with its size).
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
    """A target model folder: config.json there, and each safetensors file whole."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise UserError(f"{where} {folder}: not a Hugging Face model folder (no config.json)")
    for path in sorted(folder.glob("*.safetensors")):
        safetensors_shapes(path, where)


# --- What a command writes: apart from what it reads, and deleted only where dflash wrote it ---

WRITER_MARK = ".dflash_writer.json"  # {"writer": "launch/train.py"}: the folder was made by that command


def _relation(output: Path, input_: Path) -> str | None:
    """How `output` lies against `input_` (links resolved): "is", "lies inside", "holds", or None."""
    output, input_ = output.resolve(), input_.resolve()
    if output == input_:
        return "is"
    if input_ in output.parents:
        return "lies inside"
    if output in input_.parents:
        return "holds"
    return None


def check_apart(output: str | Path, inputs: dict, flag: str) -> None:
    """Refuse an output (`flag` names it) that is, holds or lies inside one of `inputs` (flag -> path;
    None or "" skipped): a writer would replace or delete what it reads, or write into a model or data
    folder that is not its own. Every writer calls this before any work."""
    for in_flag, path in inputs.items():
        if not path:
            continue
        relation = _relation(Path(output), Path(path))
        if relation is not None:
            raise UserError(f"{flag} {output}: {relation} {in_flag} {path}, which this command reads; what dflash "
                            f"writes stays apart from what it reads: choose another {flag}")


def written_by(folder: Path) -> str | None:
    """The dflash command that marked `folder` as its output (`WRITER_MARK`), or None."""
    try:
        return json.loads((Path(folder) / WRITER_MARK).read_text()).get("writer")
    except (OSError, ValueError, AttributeError):
        return None


def mark_folder(folder: Path, writer: str) -> None:
    """Mark `folder` as `writer`'s output: what it deletes later (`--overwrite`) is only ever there."""
    from dflash.partial import write_json

    if written_by(folder) != writer:
        write_json(Path(folder) / WRITER_MARK, {"writer": writer})


def _bookkeeping(name: str) -> bool:
    """dflash's own files in any output folder: the mark, a lock, a probe (`.dflash*`), a temporary
    `.NAME.partial-*`."""
    return name.startswith(".dflash") or name.endswith(".lock") or ".partial-" in name


def folder_entries(folder: Path, owned) -> tuple[list[Path], list[Path]]:
    """(the entries of `folder` its writer writes, the others), each sorted by name; `owned(name)`
    says which names the writer writes. dflash's bookkeeping files are in neither."""
    if not Path(folder).is_dir():
        return [], []
    entries = sorted((p for p in Path(folder).iterdir() if not _bookkeeping(p.name)), key=lambda p: p.name)
    return [p for p in entries if owned(p.name)], [p for p in entries if not owned(p.name)]


def _names(paths) -> str:
    paths = list(paths)
    return ", ".join(p.name for p in paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")


def check_own_folder(folder: Path, *, writer: str, owned, flag: str) -> list[Path]:
    """The entries of `writer` already in `folder` (a previous output), once `folder` is known to hold
    none that another wrote under those names: a folder not marked by `writer` that holds them
    (the user's own `config.json`, a model's) is refused naming them, whatever the options."""
    ours, _ = folder_entries(folder, owned)
    if ours and written_by(folder) != writer:
        raise UserError(f"{flag} {folder}: holds {_names(ours)}, which {writer} did not write (the folder has no "
                        f"{WRITER_MARK} of it); dflash replaces and deletes only what it wrote: move them away, "
                        f"or choose another {flag}")
    return ours


def delete_own(folder: Path, ours: list[Path], owned, flag: str) -> None:
    """`--overwrite`: delete `ours` (from `check_own_folder`), but only in a folder that holds nothing
    else: anything another wrote there is named and nothing is deleted."""
    import shutil

    _, others = folder_entries(folder, owned)
    if others:
        raise UserError(f"{flag} {folder}: --overwrite deletes only what dflash wrote, and the folder also holds "
                        f"{_names(others)}: move those away (or choose another {flag}); nothing was deleted")
    for p in ours:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
