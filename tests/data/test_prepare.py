"""prepare_data -> token store -> collate, against the tokenizer run on each turn by hand."""
import json
import sys

import numpy as np
import pytest

from dflash.data import TokenStore, prepare_jsonl
from dflash.data.collate import collate_packed, collate_padded
from dflash.errors import UserError

from .. import preloaded
from ..conftest import ROOT, make_chat_tokenizer
from .helpers import CONVERSATIONS, write_jsonl


@pytest.fixture
def tokenizer():
    return make_chat_tokenizer()


def expected_sample(tok, messages):
    """Tokens and mask built turn by turn: ChatML framing, loss on assistant content + <|im_end|>."""
    ids, mask = [], []
    for m in messages:
        head = tok.convert_tokens_to_ids(["<|im_start|>", m["role"]])
        body = tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        ids += head + body
        mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
    return np.array(ids), np.array(mask, dtype=bool)


def test_store_holds_template_tokens_and_assistant_only_mask(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS)
    summary = prepare_jsonl(src, tokenizer, tmp_path / "store", progress=False)
    store = TokenStore(tmp_path / "store")
    assert len(store) == summary.samples == 3
    msgs = [CONVERSATIONS[0]["messages"],
            [{"role": "user", "content": "w6 w7"}, {"role": "assistant", "content": "w8 w9 w10 w11"}],
            CONVERSATIONS[2]["messages"]]
    for i, m in enumerate(msgs):
        ids, mask = store[i]
        want_ids, want_mask = expected_sample(tokenizer, m)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(mask, want_mask)
        assert store.lengths[i] == len(want_ids) and store.supervised[i] == want_mask.sum()
    assert summary.tokens == store.total_tokens
    assert summary.assistant_tokens == sum(int(store[i][1].sum()) for i in range(3))


def test_the_batched_encoder_is_the_tokenizers_own_call(tokenizer):
    """`Encoder` (one backend call per batch) against `tokenizer(text)`, also when the tokenizer's
    backend was left truncating and a text holds special tokens."""
    from dflash.data.tokenizing import Encoder

    texts = ["<|im_start|>user\nhello world<|im_end|>\n", "w1 w2 " * 30 + "<|im_end|>", ""]
    tokenizer.backend_tokenizer.enable_truncation(4)
    encoder = Encoder(tokenizer)
    tokenizer.backend_tokenizer.no_truncation()
    encoded = encoder(texts)
    for text, (ids, starts) in zip(texts, encoded, strict=True):
        want = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids.tolist() == want["input_ids"]
        assert starts.tolist() == [a for a, _ in want["offset_mapping"]]
    assert len(encoded[1][0]) > 60  # not truncated


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_overlong_samples_are_truncated_or_dropped_and_counted(tmp_path, tokenizer, policy):
    src = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS)
    summary = prepare_jsonl(src, tokenizer, tmp_path / "store", max_length=20, overlong=policy, progress=False)
    store = TokenStore(tmp_path / "store")
    full = [len(expected_sample(tokenizer, m)[0]) for m in
            (CONVERSATIONS[0]["messages"], [{"role": "user", "content": "w6 w7"},
                                            {"role": "assistant", "content": "w8 w9 w10 w11"}],
             CONVERSATIONS[2]["messages"])]
    over = sum(n > 20 for n in full)
    assert over == 2
    if policy == "truncate":
        assert summary.truncated == over and list(store.lengths) == [min(n, 20) for n in full]
    else:
        assert summary.dropped_overlong == over and list(store.lengths) == [n for n in full if n <= 20]


def test_overlong_error_names_the_line(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS)
    with pytest.raises(UserError, match=r"in.jsonl:1: 2\d tokens, more than --max-length 20"):
        prepare_jsonl(src, tokenizer, tmp_path / "store", max_length=20, overlong="error", progress=False)
    assert not (tmp_path / "store").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"], "nothing partial left behind"


BAD_LINES = [
    ("{not json", "invalid JSON"),
    (json.dumps({"text": "hi"}), "no 'messages' or 'conversations' field"),
    (json.dumps({"messages": []}), "no turns"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "unknown role 'robot'"),
    (json.dumps({"messages": [{"role": "user", "content": "hello"}]}), "no assistant turn"),
    (json.dumps({"messages": [{"role": "assistant", "content": "hello"}]}), "no user turn"),
    (json.dumps({"messages": [{"role": "user"}]}), "must be an object with 'role' and 'content'"),
]


@pytest.mark.parametrize("line,message", BAD_LINES, ids=[m for _, m in BAD_LINES])
def test_bad_line_is_named_with_file_and_line(tmp_path, tokenizer, line, message):
    src = write_jsonl(tmp_path / "in.jsonl", [CONVERSATIONS[1], line])
    with pytest.raises(UserError, match=rf"in\.jsonl:2: .*{message}"):
        prepare_jsonl(src, tokenizer, tmp_path / "store", progress=False)


def test_skip_bad_counts_reasons(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", [CONVERSATIONS[1]] + [line for line, _ in BAD_LINES])
    summary = prepare_jsonl(src, tokenizer, tmp_path / "store", skip_bad=True, progress=False)
    assert summary.samples == 1 and summary.lines_read == 1 + len(BAD_LINES)
    assert sum(summary.skipped.values()) == len(BAD_LINES)
    assert summary.skipped["invalid JSON"] == 1 and summary.skipped["unknown role"] == 1


def test_cli_reports_user_errors_without_traceback(tmp_path, chat_tokenizer_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [CONVERSATIONS[0], "{oops"])
    script = ROOT / "launch" / "prepare_data.py"
    cmd = ["--input", src, "--tokenizer", chat_tokenizer_dir, "--output", tmp_path / "out", "--no-progress"]
    bad = preloaded.run(script, cmd)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert f"error: {src}:2: invalid JSON" in bad.stderr
    good = preloaded.run(script, cmd + ["--skip-bad"])
    assert good.returncode == 0, good.stderr
    assert "wrote 1 samples" in good.stdout and "invalid JSON: 1" in good.stdout


def test_collated_batches_match_the_store(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS)
    prepare_jsonl(src, tokenizer, tmp_path / "store", progress=False)
    store = TokenStore(tmp_path / "store")
    idx = [2, 0, 1]
    packed, padded = collate_packed(store, idx), collate_padded(store, idx, pad_id=1)
    assert packed.cu_seqlens.dtype.is_floating_point is False and packed.cu_seqlens.tolist()[0] == 0
    assert packed.max_seqlen == int(store.lengths.max())
    assert padded.computed_tokens == 3 * int(store.lengths.max()) and padded.num_tokens == packed.num_tokens
    for row, i in enumerate(idx):
        ids, mask = store[i]
        a, b = packed.cu_seqlens[row].item(), packed.cu_seqlens[row + 1].item()
        np.testing.assert_array_equal(packed.input_ids[a:b].numpy(), ids)
        np.testing.assert_array_equal(packed.loss_mask[a:b].numpy(), mask)
        np.testing.assert_array_equal(packed.position_ids[a:b].numpy(), np.arange(len(ids)))
        n = len(ids)
        np.testing.assert_array_equal(padded.input_ids[row, :n].numpy(), ids)
        assert (padded.input_ids[row, n:] == 1).all() and not padded.attention_mask[row, n:].any()
        assert not padded.loss_mask[row, n:].any()


def test_store_reads_memory_mapped_arrow(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS * 50)
    prepare_jsonl(src, tokenizer, tmp_path / "store", progress=False)
    store = TokenStore(tmp_path / "store")
    ids, _ = store[149]
    assert not ids.flags.owndata  # a view into the Arrow buffer, not a copy
    assert store.dataset.cache_files, "the dataset is backed by files on disk, not loaded into RAM"
    with pytest.raises(IndexError):
        store[150]


def test_not_a_store_is_explained(tmp_path):
    with pytest.raises(UserError, match="not a dflash token store"):
        TokenStore(tmp_path)


# ---- data safety (issue 13) ------------------------------------------------------------------
def test_overwrite_replaces_only_a_store_and_never_the_input(tmp_path, tokenizer):
    data = tmp_path / "data"
    data.mkdir()
    src = write_jsonl(data / "train.jsonl", CONVERSATIONS)
    (data / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=rf"--output {data}: holds --input {src}, which this command reads"):
        prepare_jsonl(src, tokenizer, data, overwrite=True, progress=False)
    with pytest.raises(UserError, match=rf"--output {data / 'store'}: lies inside --input {data}, which this command"):
        prepare_jsonl(data, tokenizer, data / "store", progress=False)
    other = write_jsonl(tmp_path / "other.jsonl", CONVERSATIONS)
    with pytest.raises(UserError, match=r"exists and is not a dflash token store"):
        prepare_jsonl(other, tokenizer, data, overwrite=True, progress=False)
    assert sorted(p.name for p in data.iterdir()) == ["notes.txt", "train.jsonl"], "nothing deleted"
    # a store made by dflash is replaced, atomically, and nothing temporary is left beside it
    prepare_jsonl(src, tokenizer, tmp_path / "store", progress=False)
    prepare_jsonl(other, tokenizer, tmp_path / "store", overwrite=True, max_length=20, progress=False)
    assert TokenStore(tmp_path / "store").meta["max_length"] == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "other.jsonl", "store"]
    # a store that also holds the user's file is not replaced: the file is named, nothing deleted
    (tmp_path / "store" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"--overwrite replaces only what dflash wrote, and the store also holds "
                                        r"notes.txt: move those away"):
        prepare_jsonl(src, tokenizer, tmp_path / "store", overwrite=True, progress=False)
    assert (tmp_path / "store" / "notes.txt").is_file() and TokenStore(tmp_path / "store").meta["max_length"] == 20


def chat_tokenizer_with(template):
    tok = make_chat_tokenizer()
    tok.chat_template = template
    return tok


RAISING = ("{% for m in messages %}{% if 'forbidden' in m['content'] %}{{ raise_exception('no forbidden words') }}"
           "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FAULTY_LINES = [
    (b'{"messages": [{"role": "user", "content": "h\xff"}, {"role": "assistant", "content": "w1"}]}',
     "invalid UTF-8", "invalid UTF-8 at byte"),
    (json.dumps({"messages": [{"role": "assistant", "content": "w1"}, {"role": "user", "content": "w2"},
                              {"role": "assistant", "content": "w3"}]}).encode(),
     "assistant first", "the first turn after the system prompt must be the user's"),
    (json.dumps({"messages": [{"role": "user", "content": "forbidden"}, {"role": "assistant", "content": "w1"}]})
     .encode(), "template", "the chat template refuses this conversation: no forbidden words"),
    # valid JSON and UTF-8, but "\ud800" decodes to a lone surrogate, which no tokenizer can encode
    (b'{"messages": [{"role": "user", "content": "w1 \\ud800"}, {"role": "assistant", "content": "w1"}]}',
     "not text", r"turn 0: '\\ud800' at character 3 is not text \(an unpaired surrogate escape\)"),
]


@pytest.mark.parametrize("line,reason,message", FAULTY_LINES, ids=[r for _, r, _ in FAULTY_LINES])
def test_data_faults_are_named_with_file_and_line_also_when_skipped(tmp_path, line, reason, message):
    tok = chat_tokenizer_with(RAISING)
    src = tmp_path / "in.jsonl"
    src.write_bytes(json.dumps(CONVERSATIONS[1]).encode() + b"\n" + line + b"\n")
    with pytest.raises(UserError, match=rf"in\.jsonl:2: {message}"):
        prepare_jsonl(src, tok, tmp_path / "store", progress=False)
    summary = prepare_jsonl(src, tok, tmp_path / "store", skip_bad=True, progress=False)
    assert summary.samples == 1 and summary.skipped == {reason: 1}


def test_empty_or_all_skipped_input_is_one_clear_error_with_the_counts(tmp_path, tokenizer):
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(UserError, match=r"empty\.jsonl: no usable sample in 0 line"):
        prepare_jsonl(empty, tokenizer, tmp_path / "store", progress=False)
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{oops", json.dumps({"text": 1})])
    with pytest.raises(UserError) as err:
        prepare_jsonl(bad, tokenizer, tmp_path / "store", skip_bad=True, progress=False)
    assert "no usable sample in 2 line(s)" in str(err.value) and "skipped 2 bad line(s)" in str(err.value)
    assert "1  invalid JSON" in str(err.value) and "1  missing messages" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "empty.jsonl"], "nothing left behind"


def test_store_records_fingerprints_and_notices_every_change(tmp_path, tokenizer, chat_tokenizer_dir):
    import hashlib
    import os

    from dflash.data.prepare import settings_of, store_differences
    from dflash.data.tokenizing import load_tokenizer

    src = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS)
    prepare_jsonl(src, tokenizer, tmp_path / "store", max_length=64, progress=False)
    meta = TokenStore(tmp_path / "store").meta
    assert meta["input_fingerprint"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert meta["input_fingerprint"]["size"] == src.stat().st_size
    assert meta["settings"] == settings_of(64, "truncate", False)
    same = settings_of(64, "truncate", False)
    reloaded = load_tokenizer(chat_tokenizer_dir)  # the same tokenizer, saved and loaded again
    assert store_differences(tmp_path / "store", src, reloaded, same) == []
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, not changed
    assert store_differences(tmp_path / "store", src, tokenizer, same) == []
    assert store_differences(tmp_path / "store", src, tokenizer, settings_of(32, "truncate", False)) == [
        "max_length: 64 -> 32"]
    other = make_chat_tokenizer(["w1", "w2", "hello"])
    assert [d.split(":")[0] for d in store_differences(tmp_path / "store", src, other, same)] == ["tokenizer"]
    with pytest.raises(UserError, match="its tokenizer differs from the one"):
        TokenStore(tmp_path / "store").check_tokenizer(other, "--target x")
    from dflash.data.vocab import ensure_mask_token

    ensure_mask_token(reloaded, 1000)  # as the trainer does to the target's tokenizer
    TokenStore(tmp_path / "store").check_tokenizer(reloaded, "--target x")
    size = src.stat().st_size
    src.write_text(src.read_text().replace("w8", "w9"))  # same size, same path, other content
    assert src.stat().st_size == size
    assert store_differences(tmp_path / "store", src, tokenizer, same) == [f"input: {src} changed since the store "
                                                                           "was made"]


@pytest.mark.parametrize("damage", ["arrow file deleted", "arrow file truncated", "meta not JSON", "rows lost"])
def test_damaged_store_is_a_clear_error(tmp_path, tokenizer, damage):
    src = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS)
    store = tmp_path / "store"
    prepare_jsonl(src, tokenizer, store, progress=False)
    (arrow,) = store.glob("*.arrow")
    meta = store / "dflash_store.json"
    if damage == "arrow file deleted":
        arrow.unlink()
    elif damage == "arrow file truncated":
        arrow.write_bytes(arrow.read_bytes()[:200])
    elif damage == "meta not JSON":
        meta.write_text("{")
    else:
        m = json.loads(meta.read_text())
        m["summary"]["samples"] = 4
        meta.write_text(json.dumps(m))
    with pytest.raises(UserError) as err:
        TokenStore(store)
    expected = f"{meta}: damaged store description" if damage == "meta not JSON" else f"{store}: damaged token store"
    assert str(err.value).startswith(expected) and "prepare it again" in str(err.value)


def test_partial_folders_of_dead_runs_are_removed_and_no_other(tmp_path, tokenizer):
    import os
    import subprocess

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = __import__("socket").gethostname()
    folders = {"dead": int(dead.stdout), "alive": os.getpid(), "unmarked": None}
    for name, pid in folders.items():
        (tmp_path / f".store.partial-{name}").mkdir()
        if pid is not None:
            (tmp_path / f".store.partial-{name}" / "dflash_partial.json").write_text(
                json.dumps({"pid": pid, "host": host}))
    src = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS)
    prepare_jsonl(src, tokenizer, tmp_path / "store", progress=False)
    assert sorted(p.name for p in tmp_path.glob(".store.partial-*")) == [".store.partial-alive",
                                                                         ".store.partial-unmarked"]


def test_folder_without_tokenizer_files_is_refused(tmp_path):
    from dflash.data.tokenizing import load_tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(UserError, match=r"--target .*: no tokenizer files there"):
        load_tokenizer(tmp_path, flag="--target")


def test_full_disk_while_writing_the_store_is_a_clear_error(tmp_path, tokenizer, monkeypatch):
    import errno

    import datasets

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", full)
    src = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS)
    with pytest.raises(UserError, match=r"store: the disk is full while writing the token store \(.* free\)"):
        prepare_jsonl(src, tokenizer, tmp_path / "store", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_two_preparations_into_one_output_the_second_stops_at_once(tmp_path, tokenizer):
    """Both used to say "wrote ..." and the folder held one of them: the lock beside --output is
    taken before any work, and a second writer (prepare_data, a trainer's run store) stops naming
    the first, its flag and nothing written."""
    from dflash.partial import OutputLock

    src = write_jsonl(tmp_path / "in.jsonl", CONVERSATIONS)
    out = tmp_path / "store"
    with OutputLock(out, what="preparation"):  # the first writer, still working
        with pytest.raises(UserError) as err:
            prepare_jsonl(src, tokenizer, out, progress=False)
        assert str(err.value).startswith(f"--output {out}: another preparation is writing it (process ")
        with pytest.raises(UserError, match=f"the run's token store {out}: another preparation is writing it"):
            prepare_jsonl(src, tokenizer, out, progress=False, flag="the run's token store", overwrite=True)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".store.lock", "in.jsonl"], "nothing written"
    prepare_jsonl(src, tokenizer, out, progress=False)
    assert len(TokenStore(out)) == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "store"]


@pytest.mark.slow
def test_ctrl_c_in_a_parallel_preparation_is_one_line_and_leaves_nothing(tmp_path, tokenizer):
    """Ctrl-C reaches the whole process group: each tokenizing process printed a KeyboardInterrupt
    traceback of its own. They ignore it now, and the command that stops them says so once."""
    import os
    import signal
    import subprocess
    import time

    import datasets

    from dflash.distributed.ranks import live_children

    tokenizer.save_pretrained(tmp_path / "tok")
    src = tmp_path / "in.parquet"
    rows = [c for c in CONVERSATIONS if "messages" in c]
    datasets.Dataset.from_list(rows * 30000).to_parquet(src)
    out = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch" / "prepare_data.py"), "--input", str(src),
                             "--tokenizer", str(tmp_path / "tok"), "--output", str(out), "--num-proc", "2",
                             "--no-progress"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while live_children(proc.pid) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(3)  # the workers import and start tokenizing
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2 and "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err == f"error: stopped (Ctrl-C) before the store was complete; nothing was written to {out}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet", "tok"]
