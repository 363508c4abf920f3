"""prepare_data -> token store -> collate, against the tokenizer run on each turn by hand."""
import json
import subprocess
import sys

import numpy as np
import pytest

from dflash.data import TokenStore, prepare_jsonl
from dflash.data.collate import collate_packed, collate_padded
from dflash.errors import UserError

from ..conftest import ROOT, make_chat_tokenizer

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "the answer"}, {"role": "user", "content": "hello world"},
                  {"role": "assistant", "content": "w1 w2 w3"}, {"role": "user", "content": "w4"},
                  {"role": "assistant", "content": "w5 is the answer"}]},
    {"conversations": [{"from": "human", "value": "w6 w7"}, {"from": "gpt", "value": "w8 w9 w10 w11"}]},
    {"messages": [{"role": "user", "content": "hello"},
                  {"role": "assistant", "content": " ".join(f"w{i % 50}" for i in range(40))}]},
]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


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
    assert summary.tokens == store.total_tokens and summary.assistant_tokens == sum(int(store[i][1].sum()) for i in range(3))


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
    cmd = [sys.executable, str(ROOT / "launch" / "prepare_data.py"), "--input", str(src),
           "--tokenizer", str(chat_tokenizer_dir), "--output", str(tmp_path / "out"), "--no-progress"]
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert f"error: {src}:2: invalid JSON" in bad.stderr
    good = subprocess.run(cmd + ["--skip-bad"], capture_output=True, text=True)
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
