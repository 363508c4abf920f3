"""The memory plan: its parameter counts against the real models, its estimate against the measured
peak of a training micro-step, its refusal; and the partitioned target's features on two ranks."""
import dataclasses
import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash.errors import UserError
from dflash.sizing.fit import size_run
from dflash.sizing.memory import (
    GIB,
    MemoryPlan,
    MemorySetup,
    plan_for,
    target_sizes,
)
from dflash.target.spec import load_target_spec
from dflash.testing import train_in_process
from dflash.tools import plan_memory
from dflash.training.config import load_config
from dflash.training.plan import loss_setup

from .. import preloaded
from ..conftest import ROOT
from ..runs import make_tiny_target, run_deepspeed, tiny_train_args, train_one_rank
from ..training.micro_step import planned_and_measured_micro_step


def test_target_sizes_count_the_loaded_model(tiny_run_inputs):
    target, _ = tiny_run_inputs
    sizes = target_sizes(load_target_spec(target, bare_presets=True).config)
    hf = AutoModelForCausalLM.from_pretrained(target)
    assert sizes.params == sum(p.numel() for p in hf.parameters())
    assert sizes.largest_layer == max(sum(p.numel() for p in layer.parameters()) for layer in hf.model.layers)
    assert sizes.largest_tensor == max(p.numel() for layer in hf.model.layers for p in layer.parameters())
    assert sizes.embed == hf.model.embed_tokens.weight.numel() and sizes.lm_head == hf.lm_head.weight.numel()
    assert sizes.small == sum(p.numel() for p in hf.parameters() if p.numel() <= hf.config.hidden_size)


def test_presets_have_their_public_sizes():
    billions = {name: target_sizes(load_target_spec(name, bare_presets=True).config).params / 1e9
                for name in ("qwen3-8b", "qwen3.5-27b", "qwen3.5-122b-a10b")}
    assert billions == pytest.approx({"qwen3-8b": 8.19, "qwen3.5-27b": 26.90, "qwen3.5-122b-a10b": 122.11}, abs=0.01)


# (dtype, checkpointing, --loss, the band the estimate must fall in against the measured peak), of a DFlash
# drafter; bf16 with the cross-entropy, of every drafter kind: tests/drafter/test_kind_conformance.py
MICRO_STEPS = [(torch.float32, True, "ce=1", 0.06),
               # KL and LK hold the target's probabilities once per label position, counted as once per row
               (torch.bfloat16, False, "ce=1,dpace=0.5,kl=1,lk=0.2", 0.10)]


@pytest.mark.parametrize("dtype,checkpointing,recipe,band", MICRO_STEPS)
def test_estimate_matches_the_measured_peak_of_a_micro_step(dtype, checkpointing, recipe, band):
    """Features, drafter forward and backward through the Triton kernels (the GPU's path; here in
    the interpreter), with the objective of `recipe` (its terms' vocabulary buffers, the target's
    final states for KL and LK): the plan's bytes against every tensor storage alive after each op."""
    estimate, measured, _, _ = planned_and_measured_micro_step(dtype, checkpointing, recipe, "dflash")
    assert -0.02 <= estimate / measured - 1 <= band, (estimate, measured)


# drafter rows per micro-batch (block 32 x anchors of samples cut at 128 tokens): the options that reach them
WHOLE_STEP_ROWS = {1024: "--num-anchors 32 --token-budget 128 --step-tokens 64",
                   4096: "--num-anchors 64 --token-budget 512 --step-tokens 256 --row-budget 4096",
                   18432: "--num-anchors 96 --token-budget 1024 --step-tokens 512 --row-budget 18432",
                   25600: "--num-anchors 96 --token-budget 2048 --step-tokens 1024 --row-budget 25600",
                   102400: "--num-anchors 96 --token-budget 8192 --step-tokens 4096 --row-budget 102400"}


@pytest.mark.slow
def test_the_plan_bounds_whole_steps_within_ten_percent(tmp_path):
    """Two whole steps (the second with AdamW's state and ZeRO-2's buckets) of every configuration on 2 CPU
    ranks, in one launch (`measure_memory.py --sweep`): 1K to 100K drafter rows per micro-batch with the
    target replicated, 1K and 25K partitioned, with and without activation checkpointing. On every rank the
    plan's peak for the dearest micro-batch must lie 0-10% above the tensor bytes measured after every
    op. A reduced target (hidden 16, 2 heads) keeps 100K rows within seconds; buckets of 1e5 elements,
    as ZeRO-2's default 2 x 5e7 (400 MB in fp32) would be most of every peak and hide the rest."""
    target = make_tiny_target(tmp_path / "target", hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                              head_dim=8, max_position_embeddings=256)
    ds_config = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds_config["zero_optimization"].update(reduce_bucket_size=100000, allgather_bucket_size=100000)
    (tmp_path / "zero2.json").write_text(json.dumps(ds_config))
    # partitioned at the two ends of the drafter's share (its side is the replicated one's: docs/BENCHMARKS.md
    # has all 20 configurations; the four 100K ones are most of the launch's time)
    rows = {"none": list(WHOLE_STEP_ROWS), "zero3": [1024, 25600]}
    configs = [f"{WHOLE_STEP_ROWS[n]} --target-partition {partition}{checkpointing}" for partition in rows
               for checkpointing in ("", " --activation-checkpointing") for n in rows[partition]]
    args = ["--target", target, "--data", "random:400", "--max-length", 128, "--output-dir", tmp_path / "runs",
            "--dtype", "fp32", "--draft-layers", 2, "--target-layer-ids", "0,1", "--num-workers", 0,
            "--measure-steps", 2, "--block-size", 32, "--gamma", 7, "--deepspeed_config", tmp_path / "zero2.json",
            *[arg for flags in configs for arg in ("--sweep", flags)]]
    proc = run_deepspeed(args, script=ROOT / "launch" / "measure_memory.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted((r["sweep"], r["rank"]) for r in records) == sorted((c, rank) for c in configs for rank in (0, 1))
    for r in records:
        # the rows asked for were reached (a micro-batch's rows are whole samples' blocks: within 2%)
        asked = next(rows for rows, flags in WHOLE_STEP_ROWS.items() if r["sweep"].startswith(flags))
        assert 0.98 * asked <= r["rows"] <= asked, (r["sweep"], r["rows"])
        assert 0 <= r["error"] <= 0.10, (r["sweep"], r["rank"], r["measured"], r["estimate"], r["phases"])


def qwen_plan(name, partition="none", stage=2, world_size=8):
    setup = MemorySetup(world_size=world_size, dtype_bytes=2, zero_stage=stage, bucket_elements=10**8,
                        target_partition=partition)
    return plan_for(load_target_spec(name, bare_presets=True), setup, draft_layers=5, features=5)


def test_the_row_budget_is_the_most_rows_that_fit():
    plan, memory = qwen_plan("qwen3-8b"), 80 * GIB
    rows, line = size_run(plan, memory, token_budget=16384, row_budget=0)
    usable = plan.usable(memory)
    assert plan.peak(16384, rows)["total"] <= usable < plan.peak(16384, rows + 1)["total"]
    assert f"row budget {rows:,} (the most that fits by the memory plan)" in line
    assert size_run(plan, memory, token_budget=16384, row_budget=9000)[0] == 9000
    assert size_run(plan, None, token_budget=16384, row_budget=0)[0] == 0  # no limit known: no cap


def test_a_run_that_cannot_fit_is_refused_with_what_how_much_and_which_flag():
    plan = qwen_plan("qwen3.5-122b-a10b")
    with pytest.raises(UserError) as e:
        size_run(plan, 80 * GIB, token_budget=16384, row_budget=0)
    message = str(e.value)
    assert "memory plan: this run needs about 2" in message and "more than the 74.00 GiB usable of 80.00 GiB" in message
    assert "target (a full copy) 227.45 GiB" in message and "--target-partition zero3 (peak" in message
    rows, _ = size_run(plan.partitioned(), 80 * GIB, token_budget=16384, row_budget=0)
    assert rows >= plan.min_rows()


@pytest.mark.parametrize("gib", [79.6, 139.8], ids=["80GB", "141GB"])
def test_a_dflash2_drafter_fits_within_ten_percent_of_dflash_s_anchors_on_qwen3_8b(gib):
    """The README's table (32,768-token samples, 8 GPUs, bf16, ZeRO-2, a GPU's kernels): 2,611 / 5,737 DFlash2
    anchors against 2,895 / 6,356 (1,736 / 3,866 before the convolution op, the remade outputs and the fused
    head); on CUDA the fused head holds a chunk's bf16 logits alone."""
    from dflash.training.ds_config import load_ds_config
    from dflash.training.plan import kind_settings, memory_plan, resolve_run

    spec = load_target_spec("qwen3-8b", bare_presets=True)
    ds = load_ds_config("ds_configs/zero2.json", world_size=8, grad_clip=1.0, bf16=True)
    ceilings = {}
    for kind in ("dflash", "dflash2"):
        cfg = load_config(["--data", "d.jsonl", "--drafter-kind", kind])
        run = resolve_run(cfg, spec)
        plan = memory_plan(run, ds, dtype_bytes=2, world_size=8, device="cuda", kind_settings=kind_settings(run))
        ceilings[kind] = plan.anchor_ceiling(int(gib * GIB), 32768)
    dflash2 = resolve_run(load_config(["--data", "d.jsonl", "--drafter-kind", "dflash2"]), spec)
    assert loss_setup(dflash2, "cuda")["vocab_buffers"] == 0
    assert 0.9 * ceilings["dflash"] <= ceilings["dflash2"] < ceilings["dflash"], ceilings


def test_the_anchor_ceiling_is_the_most_anchors_that_fit_and_more_are_refused_naming_it():
    plan = qwen_plan("qwen3-8b")
    for tokens in (4096, 65536):
        ceiling = plan.anchor_ceiling(80 * GIB, tokens)
        assert ceiling > 512
        for anchors, fits in ((ceiling, True), (ceiling + 1, False)):
            setup = dataclasses.replace(plan.setup, num_anchors=anchors)
            at = MemoryPlan(plan.target, plan.drafter, setup)
            if fits:
                assert size_run(at, 80 * GIB, token_budget=tokens, row_budget=0)[0] >= 16 * anchors
                assert at.peak(tokens, 16 * anchors)["total"] <= MemoryPlan.usable(80 * GIB)
                continue
            with pytest.raises(UserError, match=f"--num-anchors {anchors:,}; the most anchors a sample of "
                                                f"{tokens:,} tokens fits: {ceiling:,}"):
                size_run(at, 80 * GIB, token_budget=tokens, row_budget=0)
    assert plan.anchor_ceiling(80 * GIB, 65536) < plan.anchor_ceiling(80 * GIB, 4096)  # longer samples, fewer


@pytest.mark.slow
def test_train_refuses_a_run_that_cannot_fit_before_loading_anything(tiny_run_inputs, tmp_path):
    target, data = tiny_run_inputs
    out = tmp_path / "run"
    with pytest.raises(UserError) as refused:
        train_in_process(tiny_train_args(target, data, out, "--memory-gib", 2.2))
    # 2.2 GiB leave 0.09 GiB for tensors: ZeRO-2's 2 x 5e7-element buckets (ds_configs/zero2.json) do not fit
    message = str(refused.value)
    assert message.startswith("memory plan: this run needs about") and "--memory-gib" in message
    assert "it would fit with: --deepspeed_config ds_configs/zero3.json" in message
    assert "nothing was loaded" in message
    assert not out.exists()  # not even the run folder was claimed


def test_plan_memory_compares_the_target_replicated_and_partitioned(capsys):
    plan_memory.main(["--model", "qwen3.5-122b-a10b", "--world-size", "8", "--gpu-memory-gib", "80", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert not result["replicated"]["fits"] and result["zero3"]["fits"] and result["zero3+offload"]["fits"]
    assert result["zero3"]["peak"] < result["replicated"]["peak"] and result["zero3+offload"]["host_per_rank"] > 0
    ceiling = {int(k): v for k, v in result["zero3"]["anchor_ceiling"].items()}
    assert sorted(ceiling) == [4096, 8192, 16384, 32768, 65536]
    assert list(ceiling.values()) == sorted(ceiling.values(), reverse=True) and ceiling[65536] > 0


@pytest.mark.slow
def test_partitioned_target_gives_the_replicated_features_bitwise_with_half_the_bytes(tiny_run_inputs, tiny_store):
    target, _ = tiny_run_inputs
    proc = run_deepspeed([str(target), str(tiny_store)], script=ROOT / "tests" / "training" / "partition_script.py")
    # exit status 0, and no gloo thread left for interpreter shutdown, where a worker that still drops
    # its last collective aborts the process (SIGABRT, now and then): `end_process_group` joined them all
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted((r["rank_at_exit"], r["gloo_threads"]) for r in lines if "rank_at_exit" in r) == [(0, []), (1, [])]
    ranks = [r for r in lines if "rank" in r]
    assert sorted(r["rank"] for r in ranks) == [0, 1] and all(r["equal"] for r in ranks)
    for r in ranks:
        full = r["replicated"]["full"]
        assert r["replicated"]["resident"] == full and r["replicated"]["gathered"] == 0
        for placed in (r["zero3"], r["offload"]):
            # 1/W of every tensor, plus the norms kept gathered; at most the running and the prefetched
            # layer (the prefetch stops once past that, one tensor over at most), and the kept norms
            kept = placed["resident"] - full / 2
            assert placed["full"] == full and 0 < kept < 0.02 * full
            assert 2 * placed["layer"] < placed["gathered"] <= 2 * placed["layer"] + placed["tensor"] + kept
            assert placed["shared"] > 0


def _plan_memory(*args):
    return preloaded.run(ROOT / "launch" / "plan_memory.py", args, cwd=ROOT, timeout=300)


def test_plan_memory_refuses_a_config_without_sizes_naming_the_keys(tmp_path):
    """transformers fills a config.json's missing sizes with its defaults (hidden 4096, a 12B model):
    planning that model would answer for a target nobody has."""
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "qwen3"}')
    proc = _plan_memory("--model", config)
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: {config}: missing hidden_size, num_attention_heads, num_hidden_layers, vocab_size, "
        "intermediate_size; a target's config.json gives the model's sizes (transformers' defaults would plan a "
        "model nobody has)"]
    assert proc.stdout == ""


@pytest.mark.slow
def test_an_unsupported_family_is_refused_before_any_plan(tiny_run_inputs, tmp_path):
    from transformers import GPT2Config

    gpt2 = GPT2Config(n_embd=32, n_layer=4, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    gpt2.save_pretrained(tmp_path / "gpt2")
    refusal = ("model_type 'gpt2' is not a target dflash supports (supported: qwen3, qwen2, llama, mistral, "
               "qwen3_moe, qwen3_5_text, qwen3_5_moe_text, gpt_oss, deepseek_v3)")
    proc = _plan_memory("--model", tmp_path / "gpt2")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: --target {tmp_path / 'gpt2'}: {refusal}"], proc.stderr[-2000:]
    out = tmp_path / "run"
    with pytest.raises(UserError) as refused:
        train_in_process(tiny_train_args(tmp_path / "gpt2", tiny_run_inputs[1], out))
    assert str(refused.value) == f"--target {tmp_path / 'gpt2'}: {refusal}" and not out.exists()


@pytest.mark.slow
def test_out_of_memory_in_a_step_stops_in_one_line_and_the_last_checkpoint_resumes(tiny_run_inputs, tmp_path):
    target, data = tiny_run_inputs
    out = tmp_path / "run"
    args = tiny_train_args(target, data, out, "--max-steps", 3, "--checkpoint-every", 2, "--eval-every", 100,
                           "--no-export")
    proc = preloaded.run(ROOT / "tests" / "training" / "oom_script.py", ["3", *args], cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    checkpoint = out / "checkpoints" / "step-00000002"
    line = proc.stderr.strip().splitlines()[-1]
    match = re.fullmatch(r"error: step 3: out of memory in a micro-batch of ([\d,]+) tokens and ([\d,]+) drafter rows "
                         r"\(the memory plan: [\d.]+ [MG]iB per rank\); give a --row-budget below \2 or --token-budget "
                         r"\(now 1,024\), or add --activation-checkpointing; the last checkpoint, (.*), is intact: "
                         r"rerun with --resume", line)
    assert match, line
    assert 0 < int(match[1].replace(",", "")) <= 1024 and match[3] == str(checkpoint)
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step-00000002"]
    proc = train_one_rank(*args, "--resume", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {checkpoint} at step 2" in proc.stdout
    assert (out / "checkpoints" / "step-00000003").is_dir()
