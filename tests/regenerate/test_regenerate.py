"""Regeneration: resumable output, turn-by-turn semantics, bad input, and the prepare_data hand-off.

Uses the bundled demo target (a 1.3M-parameter Qwen3) on a handful of bundled prompts.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from dflash.demo import PROMPTS, TARGET
from dflash.errors import UserError
from dflash.regenerate import Generation, HFBackend, RegenerateConfig, load_tokenizer, regenerate, strip_thinking
from dflash.target.spec import load_target_spec

from .. import preloaded
from ..conftest import ROOT, greedy_reference, launch_script, read_jsonl

CLI = ROOT / "launch" / "regenerate.py"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(TARGET))


@pytest.fixture(scope="module")
def backend(tokenizer):
    import torch

    torch.set_num_threads(1)
    return HFBackend(load_target_spec(str(TARGET)), tokenizer, "float32")


def write_prompts(path: Path, n: int, start: int = 0) -> Path:
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()[start:start + n]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def cli_main():
    """`main` of launch/regenerate.py."""
    return launch_script("regenerate").main


CLI_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_cli(*args, timeout=300) -> subprocess.CompletedProcess:
    """`python launch/regenerate.py --target TARGET args` to its end (`tests.preloaded`: forked
    with torch and transformers imported)."""
    return preloaded.run(CLI, ["--target", TARGET, *args], env=CLI_ENV, cwd=ROOT, timeout=timeout)


def start_cli(logs: Path, *args) -> preloaded.Process:
    """The same, started: its stdout and stderr go to files in `logs`."""
    out, err = logs / "cli.out", logs / "cli.err"
    out.write_text(""), err.write_text("")
    return preloaded.Process(CLI, ["--target", TARGET, *args], CLI_ENV, ROOT, str(out), str(err))


def cfg_for(tmp_path, prompts, out="out.jsonl", **kw) -> RegenerateConfig:
    kw.setdefault("max_new_tokens", 40)
    kw.setdefault("batch_size", 4)
    return RegenerateConfig(target=str(TARGET), input=str(prompts), output=str(tmp_path / out), **kw)


@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 16)
    args = ["--input", prompts, "--batch-size", 2, "--max-new-tokens", 48]
    full = run_cli(*args, "--output", tmp_path / "full.jsonl")
    assert full.returncode == 0, full.stderr

    out = tmp_path / "resumed.jsonl"
    killed = start_cli(tmp_path, *args, "--output", out)
    deadline = time.time() + 120
    while not (out.exists() and out.read_bytes().count(b"\n") >= 2) and time.time() < deadline:
        time.sleep(0.005)
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.wait(60) == -signal.SIGKILL
    written = out.read_bytes().count(b"\n")
    assert 2 <= written < 16, "the kill must land mid-run for this test to mean anything"
    # a torn last line, as a crash in the middle of a write would leave
    with out.open("ab") as f:
        f.write(b'{"messages": [{"role": "user", "con')

    resumed = run_cli(*args, "--output", out)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed: {written} already there" in resumed.stdout
    assert out.read_bytes() == (tmp_path / "full.jsonl").read_bytes()


def test_output_loads_with_prepare_data(tmp_path, backend, tokenizer):
    from dflash.data import TokenStore, prepare_jsonl

    prompts = write_prompts(tmp_path / "prompts.jsonl", 8)
    cfg = cfg_for(tmp_path, prompts)
    regenerate(cfg, backend=backend, tokenizer=tokenizer, progress=False)
    rows = read_jsonl(Path(cfg.output))
    prepare_jsonl(cfg.output, str(TARGET), tmp_path / "store", progress=False)
    store = TokenStore(tmp_path / "store")
    assert len(store) == len(rows) == 8
    for i, row in enumerate(rows):
        ids, mask = store[i]
        assert tokenizer.decode(ids.tolist()) == tokenizer.apply_chat_template(row["messages"], tokenize=False)
        # each supervised run is one regenerated answer and its end-of-turn marker
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
        runs = [tokenizer.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2], strict=True)]
        answers = [m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant"]
        assert len(runs) == len(answers)
        assert all(r.startswith(a) and not r[len(a):].strip() for r, a in zip(runs, answers, strict=True))


def test_every_turn_is_the_targets_greedy_answer_to_its_own_history(tmp_path, backend, tokenizer):
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    multi = [r for r in rows if sum(m["role"] == "assistant" for m in r["messages"]) >= 2][:2]
    prompt_only = [r for r in rows if r["messages"][-1]["role"] == "user"][:2]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in multi + prompt_only))
    cfg = cfg_for(tmp_path, prompts, max_new_tokens=60)
    regenerate(cfg, backend=backend, tokenizer=tokenizer, progress=False)
    out = read_jsonl(Path(cfg.output))
    for src, row in zip(multi + prompt_only, out, strict=True):
        got = row["messages"]
        want_turns = len(src["messages"]) + (src["messages"][-1]["role"] == "user")
        assert len(got) == want_turns
        assert [m["role"] for m in got[: len(src["messages"])]] == [m["role"] for m in src["messages"]]
        for i, m in enumerate(got):
            if m["role"] == "assistant":
                ref = greedy_reference(backend.model, tokenizer, got[:i], cfg.max_new_tokens)
                assert m["content"] == strip_thinking(ref)
            else:
                assert m == src["messages"][i]
    assert [r["meta"]["source_line"] for r in out] == [1, 2, 3, 4]


def test_batched_generation_matches_one_at_a_time(tmp_path, backend, tokenizer):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 8, start=40)
    one = cfg_for(tmp_path, prompts, out="one.jsonl", batch_size=1)
    many = cfg_for(tmp_path, prompts, out="many.jsonl", batch_size=8)
    for cfg in (one, many):
        regenerate(cfg, backend=backend, tokenizer=tokenizer, progress=False)
    one_by_one = [r["messages"] for r in read_jsonl(Path(one.output))]
    assert one_by_one == [r["messages"] for r in read_jsonl(Path(many.output))]


def test_meta_records_settings_and_the_length_limit(tmp_path, backend, tokenizer):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    cfg = cfg_for(tmp_path, prompts, max_new_tokens=3, temperature=0.8, seed=5)
    regenerate(cfg, backend=backend, tokenizer=tokenizer, progress=False)
    for row in read_jsonl(Path(cfg.output)):
        meta = row["meta"]
        assert (meta["temperature"], meta["seed"], meta["max_new_tokens"], meta["backend"]) == (0.8, 5, 3, "hf")
        assert meta["target"] == str(TARGET)
        assert meta["hit_limit"] and all(n == 3 for n in meta["response_tokens"])


def test_sampling_is_reproducible_from_the_recorded_seed(tmp_path, backend, tokenizer):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 6)
    outs = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        cfg = cfg_for(tmp_path, prompts, out=f"{name}.jsonl", temperature=1.0, seed=seed)
        regenerate(cfg, backend=backend, tokenizer=tokenizer, progress=False)
        outs.append([r["messages"] for r in read_jsonl(Path(cfg.output))])
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


def test_resume_refuses_lines_made_with_other_settings(tmp_path, backend, tokenizer):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 2)
    regenerate(cfg_for(tmp_path, prompts, limit=1), backend=backend, tokenizer=tokenizer, progress=False)
    with pytest.raises(UserError, match=r"out.jsonl:1 was generated with other settings: temperature=0.0 \(now 0.5\)"):
        regenerate(cfg_for(tmp_path, prompts, temperature=0.5), backend=backend, tokenizer=tokenizer, progress=False)


def test_a_resume_against_changed_weights_is_refused_naming_the_target(tmp_path, backend, tokenizer):
    """Each line records its target by content: a resume after the weights changed would keep the old
    model's answers beside the new one's; the same model by another path resumes."""
    import shutil

    target = shutil.copytree(TARGET, tmp_path / "target")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 2)

    def run(name, **kw):
        cfg = RegenerateConfig(target=str(name), input=str(prompts), output=str(tmp_path / "out.jsonl"),
                               max_new_tokens=4, batch_size=1, **kw)
        return regenerate(cfg, backend=backend, tokenizer=tokenizer, progress=False, say=lambda *_: None)

    run(target, limit=1)
    (tmp_path / "link").symlink_to(target)
    assert run(tmp_path / "link", limit=1)["resumed"] == 1, "the same files under another path: the same target"
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1  # one bit, deep in the weights
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"out.jsonl:1 was generated by another model than --target {target} "
                                        r"\(by .*: its config or weights changed\)"):
        run(target)
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 1


def test_a_prompt_past_the_positions_is_named_before_the_weights_load(tmp_path, tokenizer, monkeypatch):
    from dflash.regenerate import run

    def no_loading(*_):
        raise AssertionError("the weights were loaded before the prompts were checked")

    monkeypatch.setattr(run, "load_backend", no_loading)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 9)
    long = {"messages": [{"role": "user", "content": "hello " * 2048}]}
    prompts.write_text(prompts.read_text() + json.dumps(long) + "\n")
    with pytest.raises(UserError, match=rf"{prompts}:10: the prompt of its last turn holds at least .* past the "
                                        r"target's 2,048 positions"):
        regenerate(cfg_for(tmp_path, prompts, batch_size=2), tokenizer=tokenizer, progress=False)
    assert not (tmp_path / "out.jsonl").exists()


class ScriptedBackend:
    """Answers every prompt with the same text, to test what is stored independently of a model."""

    name = "scripted"

    def __init__(self, tokenizer, text: str):
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompts, *, max_new_tokens, temperature, seeds):
        return [Generation(list(self.ids), False) for _ in prompts]


@pytest.mark.parametrize("keep, stored", [
    pytest.param(False, "The answer is 7 .", id="stripped"),
    pytest.param(True, "<think> 3 + 4 = 7 . </think>\nThe answer is 7 .", id="kept"),
])
def test_thinking_is_stripped_unless_kept(tmp_path, tokenizer, keep, stored):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 1)
    fake = ScriptedBackend(tokenizer, "<think> 3 + 4 = 7 . </think>\nThe answer is 7 .")
    cfg = cfg_for(tmp_path, prompts, keep_thinking=keep)
    regenerate(cfg, backend=fake, tokenizer=tokenizer, progress=False)
    (row,) = read_jsonl(Path(cfg.output))
    assert [m["content"] for m in row["messages"] if m["role"] == "assistant"][-1] == stored
    assert row["meta"]["keep_thinking"] is keep


BAD_LINES = [
    '{"messages": [{"role": "user", "content": "Count up from 3 to 6 ."}]}',
    '{"messages": [{"role": "user", "content": "oops"}',
    '{"messages": [{"role": "system", "content": "Answer briefly ."}, {"role": "assistant", "content": "x"}]}',
    '{"messages": [{"role": "robot", "content": "beep"}]}',
    '{"conversations": [{"from": "human", "value": "What is 2 + 3 ?"}]}',
]


def test_bad_line_stops_with_its_location(tmp_path, capsys):
    main = cli_main()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(BAD_LINES) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--target", str(TARGET), "--input", str(bad), "--output", str(tmp_path / "o.jsonl"), "--batch-size", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {bad}:2: invalid JSON" in err and "Traceback" not in err


def test_skip_bad_counts_reasons_and_keeps_the_good_lines(tmp_path, capsys):
    main = cli_main()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(BAD_LINES) + "\n")
    out = tmp_path / "o.jsonl"
    main(["--target", str(TARGET), "--input", str(bad), "--output", str(out), "--skip-bad",
          "--max-new-tokens", "8"])
    text = capsys.readouterr().out
    assert "backend: hf" in text
    assert "skipped 3 bad line(s)" in text
    for reason, line in (("invalid JSON", 2), ("no user turn", 3), ("unknown role", 4)):
        assert f"1  {reason}  (first: {bad}:{line}:" in text
    assert [r["meta"]["source_line"] for r in read_jsonl(out)] == [1, 5]


def test_user_mistakes_are_reported_without_traceback(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 1)
    proc = run_cli("--input", prompts, "--output", tmp_path / "o.jsonl", "--temperature", "-1", timeout=120)
    assert proc.returncode == 2
    assert "error: argument --temperature: must be >= 0, got -1" in proc.stderr and "Traceback" not in proc.stderr


def test_template_and_encoding_faults_are_named_by_line_also_when_skipped(tmp_path):
    from ..conftest import make_chat_tokenizer

    tok = make_chat_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['content'] == 'w13' %}{{ raise_exception('no w13') }}"
                         "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"messages": [{"role": "user", "content": "w1"}]}\n'
                    b'{"messages": [{"role": "user", "content": "w13"}]}\n'
                    b'{"messages": [{"role": "user", "content": "w\xff"}]}\n'
                    b'{"messages": [{"role": "user", "content": "w1 \\udc00"}]}\n')
    backend = ScriptedBackend(tok, "w2 w3")
    with pytest.raises(UserError, match=rf"{src}:2: the chat template refuses this conversation: no w13"):
        regenerate(cfg_for(tmp_path, src), backend=backend, tokenizer=tok, progress=False)
    stats = regenerate(cfg_for(tmp_path, src, out="skip.jsonl", skip_bad=True), backend=backend, tokenizer=tok,
                       progress=False)
    assert dict(stats["skipped"].counts) == {"template": 1, "invalid UTF-8": 1, "not text": 1}
    assert stats["skipped"].examples["not text"].startswith(f"{src}:4: turn 0: '\\udc00' at character 3 is not text")
    assert [r["meta"]["source_line"] for r in read_jsonl(tmp_path / "skip.jsonl")] == [1]


def test_input_without_a_usable_conversation_is_an_error_and_leaves_no_output(tmp_path, tokenizer):
    src = tmp_path / "in.jsonl"
    src.write_text("{oops\n")
    with pytest.raises(UserError, match=r"in\.jsonl: no usable conversation; skipped 1 bad line"):
        regenerate(cfg_for(tmp_path, src, skip_bad=True), backend=ScriptedBackend(tokenizer, "x"),
                   tokenizer=tokenizer, progress=False)
    assert not (tmp_path / "out.jsonl").exists()


# ---- the output belongs to one run and to its input (issue 28) --------------------------------
class CountingBackend(ScriptedBackend):
    """A ScriptedBackend that counts the prompts it answers; `gate` (an Event) holds it until set."""

    def __init__(self, tokenizer, text: str, gate=None):
        super().__init__(tokenizer, text)
        self.prompts, self.gate, self.started = 0, gate, None

    def generate(self, prompts, **kwargs):
        if self.gate is not None:
            self.started.set()
            self.gate.wait(60)
        self.prompts += len(prompts)
        return super().generate(prompts, **kwargs)


def asked(row: dict) -> tuple:
    """What a conversation asks: its turns other than the assistant's."""
    return tuple(m["content"] for m in row["messages"] if m["role"] != "assistant")


def test_two_runs_into_one_output_are_refused_and_no_line_is_written_twice(tmp_path, tokenizer):
    import threading

    prompts = write_prompts(tmp_path / "prompts.jsonl", 4)
    first = CountingBackend(tokenizer, "The answer is 7 .", gate=threading.Event())
    first.started = threading.Event()
    results = []
    runner = threading.Thread(target=lambda: results.append(
        regenerate(cfg_for(tmp_path, prompts), backend=first, tokenizer=tokenizer, progress=False)))
    runner.start()
    assert first.started.wait(60)
    try:
        with pytest.raises(UserError, match=rf"--output {tmp_path / 'out.jsonl'}: another regenerate run is writing "
                                            rf"it \(process {os.getpid()}@"):
            regenerate(cfg_for(tmp_path, prompts), backend=CountingBackend(tokenizer, "The answer is 3 ."),
                       tokenizer=tokenizer, progress=False)
    finally:
        first.gate.set()
        runner.join(60)
    assert results[0]["written"] == 4
    assert [r["meta"]["source_line"] for r in read_jsonl(tmp_path / "out.jsonl")] == [1, 2, 3, 4]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "the lock file goes with the run"


def test_an_edited_input_regenerates_what_changed_and_drops_what_is_gone(tmp_path, tokenizer, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 6)
    backend = CountingBackend(tokenizer, "The answer is 7 .")
    regenerate(cfg_for(tmp_path, prompts), backend=backend, tokenizer=tokenizer, progress=False)
    before = {asked(r): r for r in read_jsonl(tmp_path / "out.jsonl")}
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    next(m for m in rows[2]["messages"] if m["role"] == "user")["content"] += " again"  # edited
    del rows[4]  # removed
    rows.insert(0, {"messages": [{"role": "user", "content": "What is 1 + 1 ?"}]})  # added: every line moves
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    backend = CountingBackend(tokenizer, "The answer is 3 .")
    capsys.readouterr()
    stats = regenerate(cfg_for(tmp_path, prompts), backend=backend, tokenizer=tokenizer, progress=False)
    assert (stats["written"], stats["resumed"], stats.get("dropped")) == (2, 4, 2)
    assert capsys.readouterr().out == (f"--input {prompts} changed since {tmp_path / 'out.jsonl'} was written: 2 "
                                       "conversation(s) no longer in it are dropped, 2 new or changed ones are "
                                       "regenerated\n")
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [asked(r) for r in out] == [asked(r) for r in rows], "input order"
    assert [r["meta"]["source_line"] for r in out] == list(range(1, 7))
    for r in out:  # unchanged conversations are kept as they were (only their line number moved)
        old = before.get(asked(r))
        assert r["messages"][-1]["content"] == ("The answer is 7 ." if old else "The answer is 3 .")
        if old:
            assert {**r["meta"], "source_line": 0} == {**old["meta"], "source_line": 0}
    again = regenerate(cfg_for(tmp_path, prompts), backend=backend, tokenizer=tokenizer, progress=False)
    assert (again["written"], again["resumed"], again["dropped"]) == (0, 6, 0)


def test_an_output_of_another_input_or_a_folder_is_refused_in_one_line(tmp_path, tokenizer):
    backend = ScriptedBackend(tokenizer, "The answer is 7 .")
    first = write_prompts(tmp_path / "first.jsonl", 3)
    regenerate(cfg_for(tmp_path, first), backend=backend, tokenizer=tokenizer, progress=False)
    written = (tmp_path / "out.jsonl").read_bytes()
    other = write_prompts(tmp_path / "other.jsonl", 3, start=10)
    with pytest.raises(UserError, match=rf"--output {tmp_path / 'out.jsonl'}: 3 of its 3 conversations are not in "
                                        rf"--input {other} \(it was regenerated from {first}\); give a new --output"):
        regenerate(cfg_for(tmp_path, other), backend=backend, tokenizer=tokenizer, progress=False)
    assert (tmp_path / "out.jsonl").read_bytes() == written
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(UserError, match=r"folder.jsonl: is a folder; give the path of a JSONL file"):
        regenerate(cfg_for(tmp_path, first, out="folder.jsonl"), backend=backend, tokenizer=tokenizer, progress=False)


def test_an_output_that_is_an_input_or_the_users_own_file_is_refused_and_kept_whole(tmp_path, tokenizer):
    """--output is never what the command reads, under any spelling, nor inside the target's folder;
    a file of the user's is refused before a byte of it changes (its last line, without a newline, was
    cut as a crash's torn line before the file was found not to be a regeneration's)."""
    backend = ScriptedBackend(tokenizer, "The answer is 7 .")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 2)
    (tmp_path / "link.jsonl").symlink_to(prompts)
    with pytest.raises(UserError, match=rf"--output {tmp_path / 'link.jsonl'}: is --input {prompts}, which this "
                                        "command reads"):
        regenerate(cfg_for(tmp_path, prompts, out="link.jsonl"), backend=backend, tokenizer=tokenizer, progress=False)
    cfg = cfg_for(tmp_path, prompts)
    cfg.output = str(TARGET / "out.jsonl")
    with pytest.raises(UserError, match=rf"--output {TARGET / 'out.jsonl'}: lies inside --target {TARGET}"):
        regenerate(cfg, backend=backend, tokenizer=tokenizer, progress=False)
    for mine in (b'{"messages": []}\n{"note": 2}', b'{"note": 1}'):
        (tmp_path / "mine.jsonl").write_bytes(mine)
        with pytest.raises(UserError, match=r"mine.jsonl:1: not a line written by regenerate"):
            regenerate(cfg_for(tmp_path, prompts, out="mine.jsonl"), backend=backend, tokenizer=tokenizer,
                       progress=False)
        assert (tmp_path / "mine.jsonl").read_bytes() == mine


def test_a_full_disk_keeps_the_complete_lines_and_the_rerun_resumes(tmp_path, tokenizer, monkeypatch):
    import errno

    prompts = write_prompts(tmp_path / "prompts.jsonl", 8)
    write, writes = os.write, []

    def filling_up(fd, data):  # the second batch: half of it reaches the disk, then it is full
        if len(data) > 200:
            writes.append(len(data))
            if len(writes) == 2:
                return write(fd, bytes(data[: len(data) // 2]))
            if len(writes) == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    backend = ScriptedBackend(tokenizer, "The answer is 7 . The answer is 7 . The answer is 7 .")
    with monkeypatch.context() as m:
        m.setattr(os, "write", filling_up)
        with pytest.raises(UserError, match=r"out.jsonl: the disk is full .*; the 4 conversation\(s\) written so far "
                                            r"are complete: rerun the same command to resume once there is space"):
            regenerate(cfg_for(tmp_path, prompts), backend=backend, tokenizer=tokenizer, progress=False)
    assert [r["meta"]["source_line"] for r in read_jsonl(tmp_path / "out.jsonl")] == [1, 2, 3, 4]
    stats = regenerate(cfg_for(tmp_path, prompts), backend=backend, tokenizer=tokenizer, progress=False)
    assert (stats["written"], stats["resumed"]) == (4, 4)
    assert [r["meta"]["source_line"] for r in read_jsonl(tmp_path / "out.jsonl")] == list(range(1, 9))


def test_a_prompt_past_the_targets_positions_is_named_by_line_also_when_skipped(tmp_path, backend, tokenizer):
    """The target's positions end (2,048 for the demo target): a prompt past them was handed to the
    model. Its last prompt without responses (what it holds whatever is generated) is checked first."""
    from dflash.target.spec import load_target_spec

    positions = load_target_spec(str(TARGET)).positions
    assert positions == 2048
    prompts = write_prompts(tmp_path / "prompts.jsonl", 2)
    lines = prompts.read_text().splitlines()
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x " * positions},
                         {"role": "user", "content": "hello " * positions}]}
    prompts.write_text("\n".join([lines[0], json.dumps(long), lines[1]]) + "\n")
    with pytest.raises(UserError) as err:
        regenerate(cfg_for(tmp_path, prompts, max_new_tokens=4), backend=backend, tokenizer=tokenizer,
                   progress=False, say=lambda *_: None)
    assert str(err.value).startswith(f"{prompts}:2: the prompt of its last turn holds at least ")
    assert str(err.value).endswith(f"tokens without its responses, past the target's {positions:,} positions "
                                   "(max_position_embeddings): nothing can be generated there")
    stats = regenerate(cfg_for(tmp_path, prompts, out="skip.jsonl", max_new_tokens=4, skip_bad=True),
                       backend=backend, tokenizer=tokenizer, progress=False, say=lambda *_: None)
    assert dict(stats["skipped"].counts) == {"past the positions": 1}
    assert [r["meta"]["source_line"] for r in read_jsonl(tmp_path / "skip.jsonl")] == [1, 3]
