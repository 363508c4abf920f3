"""Identity by content: the one rule by which dflash tells whether an input is what a record was
taken of (a target for `--resume`, `--features`, regeneration's resume and a drafter's record of
its target; a data file for the token store), whatever path spells it.

A file is its size and the SHA-256 of every byte. Hashing costs (1.47 GB/s on one core of the
2-core test machine, SHA-NI: 11 s for Qwen3-8B's 16.4 GB, on top of reading them), so a record
also keeps the file's stat (device, inode, size, modification and change times): a file whose
stat is unchanged is trusted without reading it (a write changes the change time, which no user
can set back; a stat younger than `SETTLE_NS` when hashed is never trusted, the times ticking
coarsely); any other file is hashed again, so a touched but identical file matches and one
byte changed anywhere does not. A record is taken once (where the command reads the file
anyway: the run's start, a capture, a regeneration) and compared for free while nothing changed.

A target is its config.json and the weight files transformers loads (`target_files`): files
beside them that it never loads (a .gguf next to safetensors, notes) are not part of it; a .gguf
target is that file's content alone, under any name or link. A moved or copied model is the
same target; a `random:` target is its name.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from dflash.errors import UserError

CHUNK = 1 << 24
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


# File times tick coarsely (a few ms): a file changed this recently when it was hashed could change
# again with the same stat, so its stat is not trusted (it is hashed each time), as git's racy entries.
SETTLE_NS = 2 * 10**9
_HASHED: dict[tuple[int, ...], str] = {}  # this process's hashes by settled stat: runs sharing a target hash it once


def _trusted(st: os.stat_result) -> bool:
    return time.time_ns() - st.st_ctime_ns > SETTLE_NS


def file_identity(path: Path, known: dict | None = None, sha256: str | None = None) -> dict:
    """`path`'s record: size, stat and SHA-256 (`known`'s hash when `known`, a record, was taken
    of this very file unchanged; `sha256` when the caller hashed it while reading). `stat` is
    recorded only when settled (`SETTLE_NS`): a record without it is always hashed again."""
    path = Path(path)
    st = path.stat()
    key, trusted = tuple(_stat_key(st)), _trusted(st)
    if sha256 is None and trusted:
        sha256 = known["sha256"] if known and known.get("stat") == list(key) else _HASHED.get(key)
    if sha256 is None:
        sha256 = sha256_file(path)
    if trusted:
        _HASHED[key] = sha256
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "stat": list(key) if trusted else None, "sha256": sha256}


def same_file(recorded: dict, path: Path) -> bool:
    """Whether `path` holds what `recorded` (a `file_identity`) was taken of: another size never, an
    unchanged stat always, anything else by hashing it."""
    try:
        st = Path(path).stat()
    except OSError:
        return False
    if st.st_size != recorded.get("size"):
        return False
    if recorded.get("stat") == _stat_key(st):  # recorded only when settled
        return True
    return sha256_file(path) == recorded.get("sha256")


def target_files(folder: Path, gguf_file: str | None = None, where: str = "--target") -> list[Path]:
    """The files a target is: its .gguf file, or config.json and the weight files transformers'
    `from_pretrained` loads from `folder` (model.safetensors, else the shards its index names, else
    pytorch_model.bin or its shards). A folder without them, or missing a shard its index names,
    is refused in one line naming the file: before any weight loads, not a loader's traceback."""
    folder = Path(folder)
    if gguf_file:
        return [folder / gguf_file]
    files = [folder / "config.json"]
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (BIN, BIN_INDEX)):
        if (folder / single).is_file():
            return [*files, folder / single]
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise UserError(f"{where} {folder / index}: not a readable shard index ({e})") from None
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise UserError(f"{where} {folder}: {len(missing)} of the {len(shards)} weight shards its {index} "
                                f"names are missing ({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}); "
                                "download or copy the model again")
            return [*files, folder / index, *(folder / s for s in shards)]
    linked = [p.name for p in (folder / SAFETENSORS, folder / BIN) if p.is_symlink()]
    raise UserError(f"{where} {folder}: no weight file ({SAFETENSORS}, {SAFETENSORS_INDEX}, {BIN} or {BIN_INDEX})"
                    + (f"; {linked[0]} is a link to a file that is not there" if linked else "")
                    + ": an incomplete download or copy? download or copy the model again")


def target_identity(folder: Path | None, gguf_file: str | None, name: str, known: dict | None = None) -> dict:
    """The record of a target: `{"path"}` alone for one without files (`random:`); else its path
    (for messages), one SHA-256 of its files' names and hashes, and each file's `file_identity`
    (`known`: an earlier record, whose hashes are reused for files unchanged since)."""
    if folder is None:
        return {"path": name}
    reuse = {f["path"]: f for f in (known or {}).get("files", [])} if isinstance(known, dict) else {}
    by_stat = {tuple(f["stat"]): f for f in reuse.values() if f.get("stat")}
    h, files = hashlib.sha256(), []
    for f in target_files(folder, gguf_file):
        record = file_identity(f, reuse.get(str(f.resolve())) or by_stat.get(tuple(_stat_key(f.stat()))))
        # a .gguf is its content under any name; a folder's files are found by their names
        label = "gguf" if gguf_file else f.name
        h.update(f"{label}:{record['size']}:{record['sha256']}\n".encode())
        files.append(record)
    path = folder / gguf_file if gguf_file else folder
    return {"path": str(path.resolve()), "sha256": h.hexdigest(), "files": files}


def same_target(recorded: dict, now: dict) -> bool:
    """Whether two `target_identity` records are of one target: by content (a record of an older
    dflash, whose hash sampled the files and held no file list, by its path)."""
    if recorded.get("files") is not None and now.get("files") is not None:
        return recorded.get("sha256") == now.get("sha256")
    return recorded.get("path") == now.get("path")
