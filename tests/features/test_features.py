"""Features captured once (`launch/capture_features.py`, `--features`): a run that reads them trains
bitwise like the run that computes them online, and a store of another target, other data or other
taps is refused in one line."""
import json
import shutil

import pytest
import torch

from dflash.demo import DATA, TARGET
from dflash.errors import UserError
from dflash.testing import train_in_process
from dflash.tools import capture_features

from ..runs import tiny_train_args, without_timings

# the walk on the held-out turns as they are (sampling turns at T needs the target to decode)
ARGS = ("--max-steps", 3, "--eval-every", 3, "--num-target-features", 2, "--eval-sample-turns", 0)


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """The demo target's features of 40 demo conversations, tokenized by the capture itself."""
    tmp = tmp_path_factory.mktemp("features")
    data = tmp / "data.jsonl"
    data.write_text("".join(DATA.read_text(encoding="utf-8").splitlines(keepends=True)[:40]), encoding="utf-8")
    torch.set_num_threads(1)
    capture_features.main(["--target", str(TARGET), "--data", str(data), "--output",
                                            str(tmp / "features"), "--num-target-features", "2", "--dtype", "fp32"])
    return tmp / "features"


def run(out, *extra):
    train_in_process(tiny_train_args(TARGET, out.parent / "features" / "tokens", out, *ARGS, *extra))
    with open(out / "metrics.jsonl") as f:
        # what the target holds in memory differs by design: the store run holds only the embedding
        records = [{k: v for k, v in without_timings(json.loads(line)).items() if k != "target_resident_bytes"}
                   for line in f]
    return records, (out / "drafter" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_run_from_captured_features_trains_as_the_online_run(captured, layout):
    """Packed: the same bits (loss, metrics, the exported drafter). Padded: the online padded forward
    rounds differently from the packed one the store holds, so only the packed run is bitwise."""
    online = run(captured.parent / f"online-{layout}", "--layout", layout)
    offline = run(captured.parent / f"offline-{layout}", "--layout", layout, "--features", captured)
    if layout == "packed":
        assert offline == online
    else:
        losses = [[r["loss"] for r in rec if r["kind"] == "train"] for rec in (online[0], offline[0])]
        assert losses[0] == pytest.approx(losses[1], rel=1e-4)


def test_the_disk_cost_is_the_taps_and_the_final_states(captured):
    meta = json.loads((captured / "feature_store.json").read_text())
    hidden = json.loads((TARGET / "config.json").read_text())["hidden_size"]
    assert meta["bytes_per_token"] == (2 + 1) * hidden * 4
    assert (captured / "features.bin").stat().st_size == meta["tokens"] * 2 * hidden * 4


def test_a_store_of_another_target_data_or_taps_is_refused(captured, tmp_path):
    from dflash.data.prepare import prepare_jsonl
    from dflash.data.token_store import TokenStore
    from dflash.features import check_matches, read_meta
    from dflash.target.spec import load_target_spec

    meta, store = read_meta(captured), TokenStore(captured / "tokens")
    spec = load_target_spec(TARGET)
    check_matches(meta, captured, spec=spec, store=store, target_layer_ids=meta["target_layer_ids"])
    with pytest.raises(UserError, match=r"captured at target layers \[\d+, \d+\], the run taps \[1\]"):
        check_matches(meta, captured, spec=spec, store=store, target_layer_ids=[1])
    other = tmp_path / "target"
    shutil.copytree(TARGET, other)  # byte-identical at another path: the same target (identity by content)
    check_matches(meta, captured, spec=load_target_spec(other), store=store, target_layer_ids=meta["target_layer_ids"])
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one weight changed: a fine-tune of the same shapes
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match="captured from another target"):
        check_matches(meta, captured, spec=load_target_spec(other), store=store,
                      target_layer_ids=meta["target_layer_ids"])
    lines = DATA.read_text(encoding="utf-8").splitlines(keepends=True)
    (tmp_path / "other.jsonl").write_text("".join(lines[:39] + lines[40:41]), encoding="utf-8")  # one sample other
    prepare_jsonl(tmp_path / "other.jsonl", str(TARGET), tmp_path / "tokens", progress=False)
    with pytest.raises(UserError, match="captured from other data"):
        check_matches(meta, captured, spec=spec, store=TokenStore(tmp_path / "tokens"),
                      target_layer_ids=meta["target_layer_ids"])


@pytest.mark.parametrize("damage, message", [
    pytest.param("cut", r"features.bin: [\d,]+ bytes where the store's feature_store.json makes [\d,]+ \(cut short",
                 id="features-cut-in-half"),
    pytest.param("offsets", r"offsets.npy is missing \(the store's feature_store.json lists it\); capture again",
                 id="offsets-deleted"),
])
def test_a_damaged_store_is_one_line_naming_the_file(captured, tmp_path, damage, message):
    from dflash.data.token_store import TokenStore
    from dflash.features import load_captured, read_meta
    from dflash.target.spec import load_target_spec

    folder = shutil.copytree(captured, tmp_path / "features")
    if damage == "cut":
        with open(folder / "features.bin", "r+b") as f:
            f.truncate((folder / "features.bin").stat().st_size // 2)
    else:
        (folder / "offsets.npy").unlink()
    meta = read_meta(folder)
    with pytest.raises(UserError, match=message) as err:
        load_captured(folder, load_target_spec(TARGET), TokenStore(captured / "tokens"), torch.device("cpu"),
                      torch.float32, meta["target_layer_ids"])
    assert "\n" not in str(err.value)


def test_capture_refuses_taps_the_target_cannot_give_before_its_weights_load(tmp_path, monkeypatch, capsys):
    from dflash.training import target as load

    def no_loading(*_, **__):
        raise AssertionError("the weights were loaded before the taps were checked")

    monkeypatch.setattr(load, "load_target", no_loading)
    with pytest.raises(SystemExit):
        capture_features.main(["--target", str(TARGET), "--data", str(DATA), "--output",
                                                str(tmp_path / "features"), "--target-layer-ids", "1,5"])
    assert capsys.readouterr().err == (f"error: --target-layer-ids with --target {TARGET}: target layer id 5 is out "
                                       "of range: the target has 6 layers and ids must lie in [0, 4] (hidden_states[L] "
                                       "of a Hugging Face forward is the final-normed output, so layer 5 cannot be "
                                       "tapped)\n")
    assert not (tmp_path / "features").exists()
    bad = tmp_path / "bad.jsonl"  # the data are tokenized before the weights load too: a bad line is named first
    bad.write_text(DATA.read_text(encoding="utf-8").splitlines()[0] + '\n{"messages": []}\n', encoding="utf-8")
    with pytest.raises(SystemExit):
        capture_features.main(["--target", str(TARGET), "--data", str(bad), "--output",
                                                str(tmp_path / "features")])
    assert capsys.readouterr().err.endswith(f"\nerror: {bad}:2: the conversation has no turns\n")


def test_capture_by_vllm_without_vllm_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys):
    from dflash.serving import vllm

    monkeypatch.setattr(vllm, "importlib_missing", lambda module: True)
    with pytest.raises(SystemExit):
        capture_features.main(["--target", str(TARGET), "--data", str(DATA), "--output", str(tmp_path / "features"),
                               "--engine", "vllm"])
    assert capsys.readouterr().err == "error: --engine vllm: vLLM is not installed (bash launch/install.sh serve)\n"
    assert not (tmp_path / "features").exists()


def test_features_with_a_conversation_file_as_data_is_refused_before_loading(captured, tmp_path):
    with pytest.raises(UserError, match="--features: reads features captured of a model's token store"):
        train_in_process(tiny_train_args(TARGET, DATA, tmp_path / "run", "--features", captured))
    assert not (tmp_path / "run").exists()


def test_compare_recipes_reads_the_features_and_evaluates_as_online(captured):
    """The recipe sweep the store is for: every recipe's held-out loss and tau as with the target."""
    import os

    from .. import preloaded
    from ..conftest import ROOT

    results = []
    for name, extra in (("online", ()), ("offline", ("--features", captured))):
        out = captured.parent / f"recipes-{name}"
        args = [str(a) for a in tiny_train_args(TARGET, captured / "tokens", out, *ARGS[4:], *extra)]
        proc = preloaded.run(ROOT / "launch" / "compare_recipes.py",
                             [*args, "--recipes", "a: ; b: --lr 3e-3", "--steps", "2", "--seeds", "0,1",
                              "--eval-interval", "2"],
                             env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}, cwd=ROOT,
                             timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        recipes = json.loads((out / "recipes.json").read_text())["recipes"]
        results.append({r: [[{k: v for k, v in e.items() if k != "train_seconds"} for e in s["evals"]]
                            for s in stats["seeds"]] for r, stats in recipes.items()})
    assert results[0] == results[1] and len(results[0]["b"][1]) == 2


def test_a_second_capture_into_one_output_stops_at_once_and_others_files_are_refused(tmp_path, capsys):
    """Two captures into one --output used to both exit 0, one store silently replacing the other;
    a folder of the user's files under a store's names was written over."""
    from dflash.partial import OutputLock

    out = tmp_path / "features"
    args = ["--target", str(TARGET), "--data", str(DATA), "--output", str(out)]
    with OutputLock(out, what="capture"):  # as the first capture holds it, from its start
        with pytest.raises(SystemExit):
            capture_features.main(args)
    assert capsys.readouterr().err.startswith(f"error: --output {out}: another capture is writing it (process ")
    assert not out.exists(), "refused before any work"
    out.mkdir()
    (out / "features.bin").write_bytes(b"mine")
    with pytest.raises(SystemExit):
        capture_features.main(args)
    assert capsys.readouterr().err == (f"error: --output {out}: holds features.bin, which launch/capture_features.py "
                                       "did not write (the folder has no .dflash_writer.json of it); dflash replaces "
                                       "and deletes only what it wrote: move them away, or choose another --output\n")
    assert (out / "features.bin").read_bytes() == b"mine"
    with pytest.raises(SystemExit):  # the output inside the data's folder, or holding it
        capture_features.main(["--target", str(TARGET), "--data", str(DATA), "--output",
                                                str(TARGET / "features")])
    assert f"lies inside --target {TARGET}" in capsys.readouterr().err
