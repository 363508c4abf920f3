"""Conversations in both chat formats and a JSONL writer, shared by the preparation tests
(tests/data/test_prepare.py) and the training safety tests (tests/training/test_safety.py)."""
import json

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
