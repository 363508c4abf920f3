"""Helpers of the tests that train: a tiny random Qwen3 target with a chat tokenizer and a small
conversation file, built offline (the session fixtures `tiny_run_inputs` and `tiny_store` in
tests/conftest.py), DeepSpeed CPU ranks, and the run's metrics."""
import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

from dflash.distributed.ranks import free_port

from . import preloaded
from .conftest import ROOT, make_bpe_chat_tokenizer, make_chat_tokenizer

WORDS = [f"w{i}" for i in range(50)] + ["hello", "world", "the", "answer", "is"]


def make_tiny_target(path, seed=0, **sizes):
    """`sizes`: Qwen3Config fields in place of the tiny ones (hidden 64, 4 layers)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from dflash.testing import tiny_qwen3_config

    tok = make_chat_tokenizer(WORDS)
    rows = (len(tok) // 64 + 1) * 64  # padded table with spare rows, as Qwen3 has
    config = tiny_qwen3_config(**{"vocab_size": rows, **sizes}, tie_word_embeddings=False,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_family_target(path, family, seed=0):
    """A tiny random target of a `dflash.demo.families` family with a byte-level BPE chat tokenizer
    (transformers loads Qwen3.5 folders with a BPE tokenizer class whatever the folder says)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.demo.families import CONFIGS

    tok = make_bpe_chat_tokenizer(WORDS)
    config = CONFIGS[family]()
    config.vocab_size = (len(tok) // 64 + 1) * 64  # spare rows for the mask token
    config.pad_token_id, config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


TURN_LIMIT = 64


def with_turn_limit(data, path, limit=TURN_LIMIT):
    """`data`'s conversations written to `path` with `meta.max_new_tokens` = `limit` on every line, as
    `regenerate` writes it: held-out turns sampled by the target and decoded ones stop there (a random
    target seldom draws a stop token: hundreds of tokens a turn otherwise)."""
    lines = [json.loads(line) for line in Path(data).read_text().splitlines()]
    Path(path).write_text("".join(json.dumps({**row, "meta": {"max_new_tokens": limit}}) + "\n" for row in lines))
    return path


def make_conversations(path, n=60, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
            reply = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 160)))
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    return path


def released_drafter(folder, **change):
    """A drafter folder for the demo target (hidden 128, 512 rows, 6 layers) written the way released
    drafters are: torch_dtype, rope_theta, block_size at the top level, bf16 tensors; `change`
    edits config.json."""
    import torch
    from safetensors.torch import save_file

    from dflash.demo import TARGET as DEMO_TARGET
    from dflash.drafter.config_format import FULL, SLIDING
    from dflash.models import DFlashDrafter, DrafterConfig

    target = json.loads((DEMO_TARGET / "config.json").read_text())
    config = DrafterConfig.from_target(type("T", (), {**target, "rope_parameters": target["rope_parameters"]}),
                                       mask_token_id=511, block_size=8, draft_layers=3, target_layer_ids=[1, 3],
                                       layer_types=[SLIDING, SLIDING, FULL], sliding_window=4)
    drafter = DFlashDrafter(config)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()},
              folder / "model.safetensors")
    d = config.to_json_dict()
    d["torch_dtype"] = d.pop("dtype")
    d.pop("rope_parameters")
    d.update(change)
    (folder / "config.json").write_text(json.dumps(d))
    return folder


def run_deepspeed(args, num_ranks=2, timeout=600, script=None, env=None):
    """What `deepspeed --num_gpus N script args` runs on CPU ranks; returns the completed process (the
    ranks' stdout and stderr, rank by rank). The ranks are started here, forked from a process that has
    imported torch, transformers and DeepSpeed (`tests.preloaded`), with the environment and
    `--local_rank` the launcher gives them, and a rank that fails has its peers terminated as the
    launcher does: the same ranks without the launcher's two processes and each rank's 8 s of imports.
    Tests of the launcher itself (signals to it, two nodes, the tuner's trials, the README's command)
    start it. On a timeout every process is killed."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           **(env or {})}
    script, port = str(script or ROOT / "launch" / "train.py"), str(free_port())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))  # as the launcher does
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(num_ranks), LOCAL_SIZE=str(num_ranks),
               CROSS_RANK="0", CROSS_SIZE="1", CUDA_VISIBLE_DEVICES=",".join(map(str, range(num_ranks))))
    with tempfile.TemporaryDirectory() as logs:
        ranks = []
        try:
            for rank in range(num_ranks):
                out, err = (os.path.join(logs, f"{rank}.{name}") for name in ("out", "err"))
                open(out, "w").close(), open(err, "w").close()
                ranks.append(preloaded.Process(script, [f"--local_rank={rank}", *args], cwd=ROOT, stdout=out,
                                               stderr=err, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
            code = _wait_all(ranks, timeout)
        except BaseException:
            for r in ranks:
                r.kill_group()
            raise
        out, err = ("".join(open(getattr(r, name)).read() for r in ranks) for name in ("stdout", "stderr"))
    return subprocess.CompletedProcess([script, *map(str, args)], code, out, err)


# DeepSpeed's launcher polls its ranks once a second: a failed rank's peers run up to that long
# before it terminates them (time to say why they stop)
LAUNCHER_POLL_S = 1.0


def _wait_all(ranks, timeout):
    """The exit status of a run of `ranks`, with the launcher's rule: one rank fails, the others
    are terminated LAUNCHER_POLL_S later (and the run's status is the first failure's)."""
    deadline, failed, failed_at = time.monotonic() + timeout, None, None
    while any(r.poll() is None for r in ranks):
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired([r.pid for r in ranks], timeout)
        bad = next((r for r in ranks if r.returncode not in (None, 0)), None)
        if bad is not None and failed is None:
            failed, failed_at = bad.returncode, time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at >= LAUNCHER_POLL_S:
            for r in ranks:
                if r.poll() is None:
                    r.terminate()
            failed_at = float("inf")  # once, as the launcher does
        time.sleep(0.05)
    return failed if failed is not None else next((r.returncode for r in ranks if r.returncode), 0)


def train_one_rank(*args, timeout=600):
    """`python launch/train.py`, without the launcher: one rank on the CPU (what `deepspeed --num_gpus 1`
    runs, less the two launcher processes a launch would start first), forked preloaded (`run_deepspeed`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return preloaded.run(ROOT / "launch" / "train.py", args, env, ROOT, timeout)


def tiny_train_args(target, data, out, *extra):
    return ["--target", str(target), "--data", str(data), "--output-dir", str(out), "--token-budget", "1024",
            "--step-tokens", "1500", "--num-anchors", "8", "--draft-layers", "1", "--num-target-features", "2",
            "--epochs", "2", "--lr", "1e-3", "--eval-fraction", "0.1", "--no-progress", "--num-workers", "0",
            "--dtype", "fp32", "--speculate-turns", "0", *map(str, extra)]


# metric keys that measure time: they differ between otherwise identical runs
TIMING = {"step_seconds", "tokens_per_s", "computed_tokens_per_s", "rank_seconds", "rank_busy_seconds",
          "rank_wait_seconds", "wait_fraction"}


def without_timings(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMING}


def read_metrics(out, kind="train"):
    with open(out / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]
