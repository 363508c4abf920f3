"""`--target` as users name it: a model folder, a Hub id (the Hugging Face cache; offline here), a
.gguf file or a folder holding one; one resolution for every command, bad names refused in one line."""
import shutil

import pytest

from dflash.demo import PROMPTS, TARGET
from dflash.errors import UserError
from dflash.regenerate import RegenerateConfig, regenerate
from dflash.target.spec import TargetSpec, load_target_spec

from ..conftest import read_jsonl

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache holding the demo target as `dflash-test/tiny`, laid out as
    huggingface_hub lays it out: blobs, a snapshot of links to them, refs/main naming the commit."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--dflash-test--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted(p for p in TARGET.iterdir() if p.is_file())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(blob)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_a_hub_id_resolves_to_its_snapshot_in_the_cache_and_regenerates(hub_cache, tmp_path):
    spec = load_target_spec("dflash-test/tiny")
    folder = load_target_spec(str(TARGET))
    assert spec.folder == hub_cache and spec.gguf_file is None
    assert spec.config.to_diff_dict() | {"_name_or_path": ""} == folder.config.to_diff_dict() | {"_name_or_path": ""}
    assert spec.fingerprint()["sha256"] == folder.fingerprint()["sha256"]  # the same files: the same hash
    assert load_target_spec("dflash-test/tiny", "--model", bare_presets=True).folder == hub_cache  # plan_memory
    # the command a user runs, by Hub id: the same answers as from the folder
    outs = []
    for name, target in (("hub", "dflash-test/tiny"), ("folder", str(TARGET))):
        cfg = RegenerateConfig(target=target, input=str(PROMPTS), output=str(tmp_path / f"{name}.jsonl"),
                               max_new_tokens=8, batch_size=2, limit=2, backend="hf")
        regenerate(cfg, progress=False)
        outs.append([r["messages"] for r in read_jsonl(tmp_path / f"{name}.jsonl")])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("name, message", [
    pytest.param("dflash-test/absent", r"--target dflash-test/absent: not a folder or file here, and not in the "
                                       r"Hugging Face cache .* HF_HUB_OFFLINE", id="hub-id-not-cached-offline"),
    pytest.param("./no-such-model", r"no such folder or file, and not a Hugging Face Hub id", id="missing-path"),
])
def test_a_name_that_is_nothing_is_refused_in_one_line(hub_cache, name, message):
    with pytest.raises(UserError, match=message) as err:
        load_target_spec(name)
    assert "\n" not in str(err.value)


def test_a_file_or_folder_that_holds_no_single_model_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="a file that is not a .gguf model"):
        load_target_spec(tmp_path / "notes.txt")
    with pytest.raises(UserError, match=r"not a Hugging Face model folder \(no config.json, no .gguf file\)"):
        load_target_spec(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(UserError, match=r"holds 2 .gguf files \(a.gguf, b.gguf\); give the one to load"):
        load_target_spec(tmp_path)
    with pytest.raises(UserError, match=r"cannot read .*a.gguf as a GGUF model"):
        load_target_spec(tmp_path / "a.gguf")


@pytest.mark.parametrize("weights", ["model.safetensors", "model.gguf"])
def test_the_fingerprint_covers_the_weights_not_only_their_header(tmp_path, weights):
    """A fine-tune of the same shapes has the same header: the hash must see the weights themselves."""
    (tmp_path / "config.json").write_text("{}")
    data = bytearray(range(256)) * 4096  # 1 MiB: a 64 KiB header and the weights after it
    (tmp_path / weights).write_bytes(data)
    gguf = weights if weights.endswith(".gguf") else None
    spec = TargetSpec("x", None, tmp_path, False, gguf)
    before = spec.fingerprint()
    data[len(data) // 2:len(data) // 2 + 8192] = bytes(8192)  # a stretch of weights deep in the file
    (tmp_path / weights).write_bytes(data)
    assert spec.fingerprint() != before


def _fake_target(folder, size=1 << 20):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    data = bytearray(range(256)) * (size // 256)
    (folder / "model.safetensors").write_bytes(data)
    return folder, data


def _settled(monkeypatch):
    """Files as old as a model's: their stats are trusted (`SETTLE_NS`), as they are an hour on."""
    import time

    from dflash import identity

    now = time.time_ns()
    monkeypatch.setattr(identity.time, "time_ns", lambda: now + 3600 * 10**9)


@pytest.mark.parametrize("settled", [False, True], ids=["just-written", "settled"])
def test_one_byte_changed_anywhere_is_another_target_whatever_the_times_say(tmp_path, monkeypatch, settled):
    """The whole file is hashed: a byte between any windows a sampled hash reads, its modification time
    set back, is seen (a write changes the change time, which no user sets back)."""
    import os
    import time

    folder, data = _fake_target(tmp_path / "m")
    if settled:
        _settled(monkeypatch)
    spec = TargetSpec("m", None, folder, False)
    before = spec.fingerprint()
    weights = folder / "model.safetensors"
    st = weights.stat()
    time.sleep(0.05)  # past the file times' tick
    data[(1 << 16) + 10_000] ^= 1  # past the header, between sampled windows
    weights.write_bytes(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert spec.fingerprint(known=before)["sha256"] != before["sha256"]


def test_a_touched_or_moved_identical_target_is_the_same_and_unchanged_files_are_not_read(tmp_path, monkeypatch):
    import os

    from dflash import identity

    folder, _ = _fake_target(tmp_path / "m")
    _settled(monkeypatch)
    spec = TargetSpec("m", None, folder, False)
    before = spec.fingerprint()
    hashed = []
    real = identity.sha256_file
    monkeypatch.setattr(identity, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    identity._HASHED.clear()  # this process's memory aside: the record alone spares the reading
    assert spec.fingerprint(known=before) == before and hashed == [], "nothing changed: nothing is read"
    mtime = (folder / "model.safetensors").stat().st_mtime_ns + 10**9
    os.utime(folder / "model.safetensors", ns=(mtime, mtime))  # touched, the same bytes
    assert spec.fingerprint(known=before)["sha256"] == before["sha256"] and hashed == ["model.safetensors"]
    (folder / "notes.gguf").write_bytes(b"GGUF" * 100)  # a file the folder's target never loads
    (folder / "extra.pt").write_bytes(b"x")
    moved = folder.rename(tmp_path / "moved")
    assert identity.same_target(before, TargetSpec("moved", None, moved, False).fingerprint(known=before))


def test_a_gguf_through_a_link_of_another_name_is_the_same_target(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 64)
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "other-name.gguf").symlink_to(tmp_path / "model.gguf")
    direct = TargetSpec("a", None, tmp_path, False, "model.gguf").fingerprint()
    linked = TargetSpec("b", None, tmp_path / "links", False, "other-name.gguf").fingerprint()
    assert direct["sha256"] == linked["sha256"]


def test_a_folder_missing_its_weights_or_a_shard_is_one_line_before_loading(tmp_path):
    """A Hub snapshot whose weight file never downloaded, a sharded folder missing a shard its index
    names: refused by the folder check every load runs first, not a loader's traceback."""
    import json

    from dflash.folders import check_target_folder

    folder = shutil.copytree(TARGET, tmp_path / "snapshot")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(tmp_path / "blobs" / "absent")  # the cache's link, its blob gone
    with pytest.raises(UserError, match=r"no weight file \(model.safetensors, .*\); model.safetensors is a link "
                                        r"to a file that is not there") as err:
        check_target_folder(folder)
    assert "\n" not in str(err.value)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    shutil.copyfile(TARGET / "model.safetensors", folder / "model-00001-of-00002.safetensors")
    with pytest.raises(UserError, match=r"1 of the 2 weight shards its model.safetensors.index.json names are "
                                        r"missing \(model-00002-of-00002.safetensors\)"):
        load_target_spec(str(folder)).fingerprint()
