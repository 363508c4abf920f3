"""Every input format, written by `datasets` itself, prepares to the JSONL path's store, token for token."""
import json
import os
import re
import shutil

import pytest

from dflash.data import TokenStore, prepare_jsonl
from dflash.data.prepare import ensure_store, settings_of, store_differences
from dflash.errors import UserError

from .. import preloaded
from ..conftest import ROOT, make_chat_tokenizer

MESSAGES = [
    {"messages": [{"role": "system", "content": "the answer"}, {"role": "user", "content": "hello world"},
                  {"role": "assistant", "content": "w1 w2 w3"}, {"role": "user", "content": "w4"},
                  {"role": "assistant", "content": "w5 is the answer"}], "id": 0},
    {"messages": [{"role": "user", "content": "w6 w7"}, {"role": "assistant", "content": "w8 w9 w10 w11"}], "id": 1},
    {"messages": [{"role": "user", "content": "hello"},
                  {"role": "assistant", "content": " ".join(f"w{i % 50}" for i in range(40))}], "id": 2},
    {"messages": [{"role": "user", "content": "w12"}, {"role": "assistant", "content": "w13 w14"}], "id": 3},
]
ROLE_OF = {"user": "human", "assistant": "gpt", "system": "system"}
SHAREGPT = [{"conversations": [{"from": ROLE_OF[t["role"]], "value": t["content"]} for t in r["messages"]],
             "id": r["id"]} for r in MESSAGES]
STORE_COLUMNS = ("input_ids", "loss_mask", "length", "supervised")


@pytest.fixture
def tokenizer():
    return make_chat_tokenizer()


def dataset(rows):
    import datasets

    datasets.disable_progress_bars()
    return datasets.Dataset.from_list(rows)


def write_format(kind, rows, tmp_path):
    """`rows` written as `kind` by `datasets` (pyarrow for an Arrow IPC file), under a name that does
    not give the format away where the format allows it."""
    import pyarrow as pa

    ds, out = dataset(rows), tmp_path / kind
    if kind == "jsonl":
        ds.to_json(out, lines=True)
    elif kind == "json":
        ds.to_json(out, lines=False)
    elif kind == "parquet":
        ds.to_parquet(out)
    elif kind == "parquet shards":
        for i in range(3):
            (out / "data").mkdir(parents=True, exist_ok=True)
            ds.shard(3, i, contiguous=True).to_parquet(out / "data" / f"train-{i:05d}-of-00003.parquet")
    elif kind == "save_to_disk":
        ds.save_to_disk(out)
    elif kind == "arrow stream":  # what the datasets cache and save_to_disk hold
        saved = tmp_path / "saved"
        ds.save_to_disk(saved)
        shutil.copy(next(saved.glob("*.arrow")), out)
    elif kind == "arrow file":
        with pa.OSFile(str(out), "wb") as f, pa.ipc.new_file(f, ds.data.table.schema) as writer:
            writer.write_table(ds.data.table)
    return out


def columns(path):
    store = TokenStore(path)
    table = store.dataset.data.table
    return {c: table.column(c).to_pylist() for c in (*STORE_COLUMNS, "source_line")}


FORMATS = ["json", "parquet", "parquet shards", "save_to_disk", "arrow stream", "arrow file"]


@pytest.mark.parametrize("rows", [MESSAGES, SHAREGPT], ids=["messages", "sharegpt"])
@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_prepares_to_the_jsonl_store_token_for_token(kind, rows, tmp_path, tokenizer):
    want = columns(prepare_jsonl(write_format("jsonl", MESSAGES, tmp_path), tokenizer, tmp_path / "want",
                                 progress=False).output)
    summary = prepare_jsonl(write_format(kind, rows, tmp_path), tokenizer, tmp_path / "got", progress=False)
    got = columns(tmp_path / "got")
    for c in STORE_COLUMNS:
        assert got[c] == want[c], c
    assert got["source_line"] == [line - 1 for line in want["source_line"]]  # rows from 0, lines from 1
    assert summary.unit == "row" and summary.lines_read == len(rows)
    assert sum(want["supervised"]) > 0 and any(0 in m for m in want["loss_mask"])  # the mask is assistant-only


def test_tokenizing_processes_make_the_same_store(tmp_path, tokenizer):
    src = write_format("parquet", MESSAGES * 40, tmp_path)
    prepare_jsonl(src, tokenizer, tmp_path / "one", num_proc=1, progress=False)
    prepare_jsonl(src, tokenizer, tmp_path / "two", num_proc=2, progress=False)
    assert columns(tmp_path / "one") == columns(tmp_path / "two")


def test_messages_field_names_the_turns_column(tmp_path, tokenizer):
    want = columns(prepare_jsonl(write_format("jsonl", MESSAGES, tmp_path), tokenizer, tmp_path / "want",
                                 progress=False).output)
    for rows, name in ((MESSAGES, "m"), (SHAREGPT, "s")):
        renamed = [{"dialog": r.get("messages", r.get("conversations")), "id": r["id"]} for r in rows]
        src = write_format("parquet", renamed, tmp_path)
        with pytest.raises(UserError, match=r"no 'messages' or 'conversations' column \(columns: dialog, id\)"):
            prepare_jsonl(src, tokenizer, tmp_path / name, progress=False)
        prepare_jsonl(src, tokenizer, tmp_path / name, messages_field="dialog", progress=False)
        assert {c: v for c, v in columns(tmp_path / name).items() if c != "source_line"} == \
            {c: want[c] for c in STORE_COLUMNS}


def test_unknown_formats_and_missing_columns_are_one_line_naming_file_formats_and_columns(tmp_path, tokenizer):
    junk = tmp_path / "data.parquet"  # the name says parquet, the content does not
    junk.write_bytes(b"\x00\x01binary junk")
    with pytest.raises(UserError) as err:
        prepare_jsonl(junk, tokenizer, tmp_path / "s", progress=False)
    assert str(err.value) == (f"{junk}: not a data format dflash reads (it starts with b'\\x00\\x01binary'); "
                              "accepted: JSONL, JSON (an array of objects), parquet, Arrow (IPC file or stream), a "
                              "folder of parquet shards, a datasets save_to_disk folder")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"--input .*empty: a folder with neither parquet files nor a datasets "
                                        r"save_to_disk dataset \(state.json, dataset_info.json\); accepted: JSONL"):
        prepare_jsonl(tmp_path / "empty", tokenizer, tmp_path / "s", progress=False)
    text = write_format("save_to_disk", [{"text": "hi", "id": 1}], tmp_path)
    with pytest.raises(UserError) as err:
        prepare_jsonl(text, tokenizer, tmp_path / "s", messages_field="turns", progress=False)
    assert str(err.value) == f"{text}: no column 'turns' (--messages-field); columns: text, id"
    # the command line: one line, status 2, before anything is tokenized (the tokenizer is not read yet;
    # a folder apart from the output's: the output may not lie inside it)
    from dflash.demo import TARGET

    proc = preloaded.run(ROOT / "launch" / "prepare_data.py", ["--input", text, "--tokenizer", TARGET, "--output",
                                                                tmp_path / "s"], timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr == (f"error: {text}: no 'messages' or 'conversations' column (columns: text, id); accepted "
                           "layouts: 'messages' [{role, content}], ShareGPT 'conversations' [{from, value}], or "
                           "--messages-field COLUMN\n")
    assert not (tmp_path / "s").exists()


def test_a_bad_row_is_named_by_file_and_row_also_when_skipped(tmp_path, tokenizer):
    rows = [dict(r) for r in MESSAGES]
    rows[2] = {"messages": [{"role": "robot", "content": "x"}], "id": 2}
    shards = write_format("parquet shards", rows, tmp_path)
    shard = shards / "data" / "train-00001-of-00003.parquet"  # row 2 of 4 (3 shards of 2, 1, 1)
    with pytest.raises(UserError) as err:
        prepare_jsonl(shards, tokenizer, tmp_path / "s", progress=False)
    assert str(err.value).startswith(f"{shard}: row 0: turn 0 has unknown role 'robot'")
    summary = prepare_jsonl(shards, tokenizer, tmp_path / "s", skip_bad=True, progress=False)
    assert summary.samples == 3 and summary.skipped == {"unknown role": 1}
    assert columns(tmp_path / "s")["source_line"] == [0, 1, 3]


def test_a_changed_folder_is_prepared_again_and_a_resume_refuses_it(tmp_path, tokenizer):
    shards = write_format("parquet shards", MESSAGES, tmp_path)
    store, said = tmp_path / "run" / "data", []
    ensure_store(shards, tokenizer, store, max_length=64, progress=False, say=said.append)
    same = settings_of(64, "truncate", False)
    assert store_differences(store, shards, tokenizer, same) == []
    first = shards / "data" / "train-00000-of-00003.parquet"
    os.utime(first)  # touched, not changed: still the same content
    assert store_differences(store, shards, tokenizer, same) == []
    dataset(MESSAGES[1:4]).to_parquet(first)  # three conversations where there were two
    assert store_differences(store, shards, tokenizer, same) == [f"input: {shards} changed since the store was made"]
    with pytest.raises(UserError, match="--resume: the run's token store .* was made of other data"):
        ensure_store(shards, tokenizer, store, max_length=64, refuse_changes=True, progress=False, say=said.append)
    ensure_store(shards, tokenizer, store, max_length=64, progress=False, say=said.append)
    assert said[-3].startswith(f"rebuilding {store}: input: {shards} changed")
    assert len(TokenStore(store)) == len(MESSAGES) + 1
    (shards / "data" / "train-00002-of-00003.parquet").unlink()  # a shard less
    assert store_differences(store, shards, tokenizer, same) == [f"input: {shards} changed since the store was made"]


def test_a_token_store_folder_is_no_conversation_input(tmp_path, tokenizer):
    from dflash.data.sources import is_token_store
    from dflash.training.data import store_path

    src = write_format("jsonl", MESSAGES, tmp_path)
    prepare_jsonl(src, tokenizer, tmp_path / "store", progress=False)
    saved = write_format("save_to_disk", MESSAGES, tmp_path)
    assert is_token_store(tmp_path / "store") and not is_token_store(saved)
    assert store_path(tmp_path / "store", tmp_path / "run") == tmp_path / "store"
    assert store_path(saved, tmp_path / "run") == tmp_path / "run" / "data"
    with pytest.raises(UserError, match=r"is a dflash token store \(prepared data\), not conversations"):
        prepare_jsonl(tmp_path / "store", tokenizer, tmp_path / "again", progress=False)


def test_regenerate_reads_a_parquet_input_as_its_jsonl_and_resumes_it(tmp_path):
    import torch

    from dflash.demo import PROMPTS, TARGET
    from dflash.regenerate import HFBackend, RegenerateConfig, load_tokenizer, regenerate
    from dflash.target.spec import load_target_spec

    torch.set_num_threads(1)
    tok = load_tokenizer(str(TARGET))
    backend = HFBackend(load_target_spec(str(TARGET)), tok, "float32")
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()[:3]]
    outputs = {}
    for kind in ("jsonl", "parquet"):
        out = tmp_path / f"{kind}.out.jsonl"
        cfg = RegenerateConfig(target=str(TARGET), input=str(write_format(kind, rows, tmp_path)), output=str(out),
                               max_new_tokens=6, batch_size=2, dtype="float32")
        regenerate(cfg, backend=backend, tokenizer=tok, progress=False, say=lambda *_: None)
        outputs[kind] = [json.loads(x) for x in out.read_text().splitlines()]
        stats = regenerate(cfg, backend=backend, tokenizer=tok, progress=False, say=lambda *_: None)
        assert stats["resumed"] == 3 and stats["written"] == 0
    assert [x["meta"]["source_line"] for x in outputs["parquet"]] == [0, 1, 2]
    assert [x["messages"] for x in outputs["parquet"]] == [x["messages"] for x in outputs["jsonl"]]


def test_train_py_checks_the_data_and_its_column_before_anything_loads(tmp_path, tokenizer):
    from dflash.training.config import load_config
    from dflash.training.data import chat_data, check_data

    src = write_format("parquet", [{"dialog": r["messages"], "id": r["id"]} for r in MESSAGES], tmp_path)
    with pytest.raises(UserError, match=r"parquet: no 'messages' or 'conversations' column \(columns: dialog, id\)"):
        check_data(*_sections(load_config(["--data", str(src)])))
    with pytest.raises(UserError, match=r"parquet: no column 'turns' \(--messages-field\); columns: dialog, id"):
        check_data(*_sections(load_config(["--data", str(src), "--messages-field", "turns"])))
    check_data(*_sections(load_config(["--data", str(src), "--messages-field", "dialog"])))
    store = prepare_jsonl(write_format("jsonl", MESSAGES, tmp_path), tokenizer, tmp_path / "store",
                          progress=False).output
    with pytest.raises(UserError, match="--messages-field dialog: --data .* is a token store"):
        check_data(*_sections(load_config(["--data", store, "--messages-field", "dialog"])))
    with pytest.raises(UserError, match="--messages-field: names a column of conversations; --data random"):
        load_config(["--target", "random:qwen3-0.6b", "--data", "random", "--messages-field", "dialog"])
    # the target's chat template renders conversations of every format, and nothing else
    assert chat_data(load_config(["--data", str(src)]).inputs) == str(src)
    assert chat_data(load_config(["--data", store]).inputs) is None


def test_train_py_trains_on_a_parquet_file_with_its_messages_field(tmp_path):
    """`python launch/train.py --data conv.parquet --messages-field dialog`: prepared into the run
    folder as the JSONL would be, and trained."""
    from transformers import AutoTokenizer

    from dflash.testing import train_in_process

    from ..runs import make_conversations, make_tiny_target

    target, data = make_tiny_target(tmp_path / "target"), make_conversations(tmp_path / "data.jsonl")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    src = tmp_path / "conv.parquet"
    dataset([{"dialog": r["messages"]} for r in rows]).to_parquet(src)
    train_in_process(["--target", target, "--data", src, "--output-dir", tmp_path / "run", "--token-budget", 1024,
                      "--step-tokens", 1500, "--num-anchors", 8, "--draft-layers", 1, "--num-target-features", 2,
                      "--max-steps", 1, "--no-progress", "--num-workers", 0, "--dtype", "fp32", "--no-export",
                      "--eval-every", 0, "--speculate-turns", 0, "--messages-field", "dialog"])
    store = TokenStore(tmp_path / "run" / "data")
    assert store.meta["input_format"] == "parquet" and store.meta["settings"]["messages_field"] == "dialog"
    want = prepare_jsonl(data, AutoTokenizer.from_pretrained(str(target)), tmp_path / "want", progress=False,
                         max_length=1024).output
    assert columns(tmp_path / "run" / "data") == {**columns(want), "source_line": list(range(len(rows)))}
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1]


def _store_of_jsonl(rows, tmp_path, tokenizer, name):
    src = tmp_path / f"{name}.jsonl"
    dataset(rows).to_json(src, lines=True)
    return {c: v for c, v in columns(prepare_jsonl(src, tokenizer, tmp_path / name, progress=False).output).items()
            if c != "source_line"}


def _prepared(src, tmp_path, tokenizer, **kw):
    out = tmp_path / "got"
    shutil.rmtree(out, ignore_errors=True)
    prepare_jsonl(src, tokenizer, out, progress=False, **kw)
    return {c: v for c, v in columns(out).items() if c != "source_line"}


def test_a_json_array_is_read_as_written_a_number_among_strings_is_refused_by_row(tmp_path, tokenizer):
    """datasets' JSON builder turned the whole `content` column into JSON text when one turn held a
    number, wrapping every turn in quotes: each object is now decoded as the file says."""
    rows = json.loads(json.dumps(MESSAGES))
    src = tmp_path / "num.json"
    src.write_text(json.dumps(rows))
    assert _prepared(src, tmp_path, tokenizer) == _store_of_jsonl(MESSAGES, tmp_path, tokenizer, "want")
    rows[2]["messages"][0]["content"] = 12345
    src.write_text(json.dumps(rows, indent=1))
    with pytest.raises(UserError) as err:
        prepare_jsonl(src, tokenizer, tmp_path / "s", progress=False)
    assert str(err.value) == f"{src}: row 2: turn 0: 'content' must be a string"
    summary = prepare_jsonl(src, tokenizer, tmp_path / "s", skip_bad=True, progress=False)
    assert summary.samples == 3 and summary.skipped == {"malformed turn": 1}


def test_json_arrays_larger_than_a_chunk_and_broken_ones(tmp_path, tokenizer, monkeypatch):
    from dflash.data import tables

    monkeypatch.setattr(tables, "CHUNK", 7)  # every object straddles chunks
    src = tmp_path / "a.json"
    src.write_text(" " * 20 + "\n[ " + " ,\n".join(json.dumps(r) for r in MESSAGES) + " ]\n")  # blank: a chunk
    assert list(tables.json_array_rows(src)) == MESSAGES
    for text, error in [("[" + json.dumps(MESSAGES[0]) + ", {\"messages\": [", "row 1: invalid JSON"),
                        ("[" + json.dumps(MESSAGES[0]) + " {}]", "row 0: invalid JSON (expected ',' or ']' after it)"),
                        ("[] []", "text after the JSON array's end")]:
        src.write_text(text)
        with pytest.raises(UserError, match=re.escape(f"{src}: {error}")):
            list(tables.json_array_rows(src))


def test_a_hub_folder_of_several_splits_needs_split_and_a_datasetdict_takes_it(tmp_path, tokenizer):
    import datasets

    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    dataset(MESSAGES[:3]).to_parquet(hub / "data" / "train-00000-of-00001.parquet")
    dataset(MESSAGES[3:]).to_parquet(hub / "data" / "test-00000-of-00001.parquet")
    (hub / "README.md").write_text("---\nconfigs: []\n---\n# a dataset card\n")  # files of no data format,
    (hub / "dataset_infos.json").write_text('{"default": {"splits": {}}}\n')  # and datasets' own: left out
    with pytest.raises(UserError) as err:
        prepare_jsonl(hub, tokenizer, tmp_path / "s", progress=False)
    assert str(err.value) == (f"--input {hub}: holds the splits train, test (train: 1 file(s), test: 1 file(s)); "
                              "choose one with --split, e.g. --split train")
    # the Hub's data/ folder itself, given as the input: datasets' FileNotFoundError traceback before
    with pytest.raises(UserError) as err:
        prepare_jsonl(hub / "data", tokenizer, tmp_path / "s", progress=False)
    assert str(err.value) == (f"--input {hub / 'data'}: holds the splits train, test (train: 1 file(s), test: 1 "
                              "file(s)); choose one with --split, e.g. --split train")
    want = _store_of_jsonl(MESSAGES[:3], tmp_path, tokenizer, "want")
    assert _prepared(hub, tmp_path, tokenizer, split="train") == want
    assert _prepared(hub / "data", tmp_path, tokenizer, split="train") == want
    with pytest.raises(UserError, match=r"--split validation: .*hub holds the splits train, test"):
        prepare_jsonl(hub, tokenizer, tmp_path / "s", split="validation", progress=False)
    saved = tmp_path / "dict"
    datasets.DatasetDict({"train": dataset(MESSAGES[:3]), "test": dataset(MESSAGES[3:])}).save_to_disk(saved)
    with pytest.raises(UserError, match=r"a DatasetDict with splits train, test; choose one with --split"):
        prepare_jsonl(saved, tokenizer, tmp_path / "s", progress=False)
    assert _prepared(saved, tmp_path, tokenizer, split="train") == want
    from dflash.training.config import load_config
    from dflash.training.data import check_data  # train.py has no --split: it is told to prepare one

    with pytest.raises(UserError, match=r"prepare one split into a token store \(prepare_data.py --input .*hub "
                                        r"--split train\) and pass the store as --data"):
        check_data(*_sections(load_config(["--data", str(hub)])))
    from dflash.demo import TARGET
    from dflash.regenerate import RegenerateConfig

    regenerate = RegenerateConfig(target=str(TARGET), input=str(hub), output=str(tmp_path / "out.jsonl"))
    with pytest.raises(UserError, match="holds the splits train, test .*; choose one with --split, e.g. --split train"):
        regenerate.validate()
    RegenerateConfig(target=str(TARGET), input=str(hub), output=str(tmp_path / "out.jsonl"), split="test").validate()


def test_an_empty_shard_in_a_folder_is_refused_naming_it(tmp_path, tokenizer):
    """A zero-byte parquet shard (a download cut short) was skipped silently: the data lost a shard."""
    shards = tmp_path / "shards"
    shards.mkdir()
    dataset(MESSAGES[:2]).to_parquet(shards / "part-0.parquet")
    (shards / "part-1.parquet").write_bytes(b"")
    with pytest.raises(UserError) as err:
        prepare_jsonl(shards, tokenizer, tmp_path / "s", progress=False)
    assert str(err.value) == (f"{shards / 'part-1.parquet'}: an empty parquet file (0 bytes) in the data folder "
                              f"{shards}; download or copy it again, or remove it")
    assert not (tmp_path / "s").exists()


def test_a_folder_of_several_formats_is_refused_naming_one_file_of_each(tmp_path, tokenizer):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    dataset(MESSAGES[:2]).to_parquet(mixed / "a.parquet")
    dataset(MESSAGES[2:]).to_json(mixed / "b.jsonl", lines=True)
    with pytest.raises(UserError) as err:
        prepare_jsonl(mixed, tokenizer, tmp_path / "s", progress=False)
    assert str(err.value) == (f"--input {mixed}: holds data files of several formats (parquet: a.parquet, jsonl: "
                              "b.jsonl); dflash reads a folder whole: give one file, or a folder of parquet shards "
                              "only")


def test_messages_field_decides_over_a_messages_column_beside_it(tmp_path, tokenizer):
    other = [{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}] * len(SHAREGPT)
    src = tmp_path / "both.parquet"
    dataset([{**o, "conversations": s["conversations"]} for o, s in zip(other, SHAREGPT, strict=True)]).to_parquet(src)
    assert _prepared(src, tmp_path, tokenizer, messages_field="conversations") == \
        _store_of_jsonl(MESSAGES, tmp_path, tokenizer, "want")
    assert _prepared(src, tmp_path, tokenizer) == _store_of_jsonl(other, tmp_path, tokenizer, "other")


def test_turns_as_json_text_are_decoded_and_other_column_types_refused_naming_the_column(tmp_path, tokenizer):
    src = tmp_path / "text.parquet"
    dataset([{"messages": json.dumps(r["messages"]), "id": r["id"]} for r in MESSAGES]).to_parquet(src)
    assert _prepared(src, tmp_path, tokenizer) == _store_of_jsonl(MESSAGES, tmp_path, tokenizer, "want")
    dataset([{"messages": "[{\"role\": \"user\""}]).to_parquet(src)
    with pytest.raises(UserError, match=re.escape(f"{src}: row 0: column 'messages': not JSON text of turns")):
        prepare_jsonl(src, tokenizer, tmp_path / "s", progress=False)
    dataset([{"messages": [{"role": "user", "content": 1}]}]).to_parquet(src)
    with pytest.raises(UserError) as err:
        prepare_jsonl(src, tokenizer, tmp_path / "s", progress=False)
    assert str(err.value) == (f"{src}: column 'messages' is list<element: struct<role: string, content: int64>>; "
                              "expected a list of turns with string 'role' and 'content' (or 'from' and 'value'), "
                              "or JSON text of such a list")


def test_a_cut_arrow_stream_is_one_line(tmp_path, tokenizer):
    stream = write_format("arrow stream", MESSAGES * 50, tmp_path)
    stream.write_bytes(stream.read_bytes()[:stream.stat().st_size // 2])
    with pytest.raises(UserError, match=re.escape(f"{stream}: cannot be read to the end (OSError: ")):
        prepare_jsonl(stream, tokenizer, tmp_path / "s", progress=False)


def test_a_changed_shard_is_refused_on_resume_before_the_target_loads(tmp_path, tokenizer):
    """`check_data` runs before the target loads; the resumed run's store used to be compared only
    once the target's tokenizer was there (after its weights loaded)."""
    from dflash.training.config import load_config
    from dflash.training.data import check_data

    shards = write_format("parquet shards", MESSAGES, tmp_path)
    run = tmp_path / "run"
    ensure_store(shards, tokenizer, run / "data", max_length=64, progress=False, say=lambda *_: None)
    resume = ["--data", str(shards), "--output-dir", str(run), "--resume"]
    check_data(*_sections(load_config(resume)))  # unchanged: accepted
    dataset(MESSAGES[1:4]).to_parquet(shards / "data" / "train-00000-of-00003.parquet")
    with pytest.raises(UserError) as err:
        check_data(*_sections(load_config(resume)))
    assert str(err.value).splitlines()[:2] == [f"--resume: the run's token store {run / 'data'} was made of other "
                                               "data or settings:", f"  input: {shards} changed since the store was "
                                               "made"]
    check_data(*_sections(load_config([*resume, "--force-resume"])))  # forced: rebuilt later, as before
    check_data(*_sections(load_config(resume[:-1] + ["--overwrite"])))  # a new run: rebuilt


def test_samples_past_the_targets_positions_are_named_in_a_warning():
    import numpy as np

    from dflash.training.data import positions_warning

    name = "sample {}".format
    assert positions_warning(np.array([10, 2048]), 2048, name) is None
    assert positions_warning(np.array([10, 4096]), None, name) is None  # a config without positions
    text = positions_warning(np.array([10, 3000, 2049, 5]), 2048, name)
    assert text.startswith("2 of 4 samples are longer than the target's 2,048 positions (max_position_embeddings), "
                           "the longest sample 1 with 3,000 tokens") and "--max-length 2048" in text


def _sections(cfg):
    """What `check_data` reads of a config: its inputs and run sections."""
    return cfg.inputs, cfg.run
