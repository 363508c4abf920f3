"""Crashes, resumes, non-finite steps, determinism and bad input, with real DeepSpeed CPU ranks.

Every multi-rank run is compared with one uninterrupted reference run of the same settings:
loss curves, evaluations and the samples each step used (`--sample-log`) must be identical.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.errors import UserError
from dflash.training.ds_config import load_ds_config

from ..conftest import ROOT
from ..runs import read_metrics, run_deepspeed, tiny_train_args, train_one_rank, without_timings

pytestmark = pytest.mark.slow

FAULTS = ROOT / "tests" / "training" / "fault_script.py"
# 2 epochs of 4 steps on 2 ranks, a checkpoint every 2 steps. Round-robin dealing (--no-balance): the
# fault points below are placed in its step layout (dealing by cost, the default, makes 3 + 4 steps of
# other micro-batches; its stop and resume across nodes: test_multinode)
COMMON = ("--step-tokens", 600, "--checkpoint-every", 2, "--sample-log", "--no-export", "--no-balance",
          "--deepspeed_config", "ds_configs/zero2.json")


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def history(out):
    """What a run learned and saw: metric records without timings, and each rank's sample log."""
    with open(out / "metrics.jsonl") as f:
        records = [without_timings(json.loads(line)) for line in f]
    samples = {p.name: p.read_text().splitlines() for p in sorted(out.glob("samples.rank*.jsonl"))}
    return records, samples


def complete_checkpoints(out):
    return sorted(p.name for p in (out / "checkpoints").iterdir() if (p / "COMPLETE").is_file())


def shared_memory_buffers():
    shm = Path("/dev/shm")
    return set(shm.glob("deepspeed_allreduce_buffer_*")) if shm.is_dir() else set()


@pytest.fixture(scope="module")
def reference(tiny_run_inputs, tmp_path_factory):
    """The reference run, in a torch extensions folder where a killed build left its lock behind
    (the state that once made every later run on a CI machine wait forever)."""
    target, data = tiny_run_inputs
    out = tmp_path_factory.mktemp("reference") / "run"
    extensions = tmp_path_factory.mktemp("torch_extensions")
    (extensions / "deepspeed_shm_comm").mkdir()
    (extensions / "deepspeed_shm_comm" / "lock").touch()
    before = shared_memory_buffers()
    ok(run_deepspeed(tiny_train_args(target, data, out, *COMMON), timeout=300,
                     env={"TORCH_EXTENSIONS_DIR": str(extensions)}))
    (out / "leaked_shm.json").write_text(json.dumps(sorted(map(str, shared_memory_buffers() - before))))
    (out / "built.json").write_text(json.dumps(sorted(str(p.relative_to(extensions)) for p in extensions.rglob("*"))))
    return out


def test_cpu_ranks_build_nothing_and_leave_no_shared_memory_behind(reference):
    assert json.loads((reference / "leaked_shm.json").read_text()) == []
    assert json.loads((reference / "built.json").read_text()) == ["deepspeed_shm_comm", "deepspeed_shm_comm/lock"]


def test_reference_run_sees_every_training_sample_once_per_epoch(reference):
    records, samples = history(reference)
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 9))
    seen = {0: Counter(), 1: Counter()}
    for lines in samples.values():
        for entry in map(json.loads, lines):
            for ids in entry["samples"]:
                seen[entry["epoch"]].update(ids)
    assert set(seen[0]) == set(seen[1]) and len(seen[0]) == 54  # 60 samples, 6 held out
    assert all(n == 1 for epoch in seen.values() for n in epoch.values())


@pytest.fixture(scope="module")
def stopped_and_resumed(tiny_run_inputs, tmp_path_factory):
    """A second fresh run of the reference's settings, stopped after step 3 (its history then), and
    its resume to the end: two launches that the determinism and the resume tests both read."""
    target, data = tiny_run_inputs
    out = tmp_path_factory.mktemp("stopped") / "run"
    ok(run_deepspeed(tiny_train_args(target, data, out, *COMMON, "--stop-at-step", 3)))
    stopped = history(out)
    resumed = ok(run_deepspeed(tiny_train_args(target, data, out, *COMMON, "--resume")))
    return stopped, resumed, history(out)


def test_same_seed_and_world_size_give_identical_runs(reference, stopped_and_resumed):
    """The fresh run's steps (up to its stop) repeat the reference's: records and every rank's samples."""
    (records, samples), _, _ = stopped_and_resumed
    ref_records, ref_samples = history(reference)
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("train", 3)]
    assert records == [r for r in ref_records if r["kind"] == "train" and r["step"] <= 3]
    assert samples.keys() == ref_samples.keys() == {"samples.rank0.jsonl", "samples.rank1.jsonl"}
    assert all(lines == ref_samples[rank][:3] and len(lines) == 3 for rank, lines in samples.items())


def test_stopped_and_resumed_run_equals_the_uninterrupted_one(reference, stopped_and_resumed):
    _, resumed, resumed_history = stopped_and_resumed
    assert "resumed from" in resumed.stdout and "at step 3 (epoch 0" in resumed.stdout, "inside an epoch"
    assert resumed_history == history(reference)


def test_a_finished_partitioned_run_exits_0_with_no_gloo_thread_left_for_interpreter_shutdown(tiny_run_inputs,
                                                                                            tmp_path):
    """A gloo worker still dropping its last collective at interpreter shutdown aborts the process
    (SIGABRT), now and then: the CLI's exit joins every gloo thread first, also those of the groups
    that DeepSpeed's engines (the drafter's optimizer hooks, the partitioned target) keep."""
    target, data = tiny_run_inputs
    args = tiny_train_args(target, data, tmp_path / "run", "--target-partition", "zero3", "--epochs", 1, "--no-export")
    proc = ok(run_deepspeed(args, script=ROOT / "tests" / "training" / "exit_script.py"))
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank_at_exit"')]
    assert sorted((r["rank_at_exit"], r["gloo_threads"]) for r in lines) == [(0, []), (1, [])], proc.stdout[-2000:]


def test_partitioned_target_with_a_killed_peer_is_one_line_and_resumes_bitwise_like_the_replicated_reference(
        reference, tiny_run_inputs, tmp_path):
    """--target-partition zero3: the same losses, evaluations and samples, bit for bit, through a
    peer's death (one line on rank 0) and a resume; only the target bytes each rank holds differ
    (about half), and tau@1, which walks the data's turns (a partitioned target does not sample
    turns) where the reference walks turns the target sampled."""
    target, data = tiny_run_inputs
    out = tmp_path / "run"
    partitioned = (*COMMON, "--target-partition", "zero3")
    # a peer killed in a partitioned step (rank 1, after its first backward of step 3): rank 0, in
    # a collective of the partitioned target or the step, says so in one line
    killed = run_deepspeed(["kill-mid-step@3:1", *tiny_train_args(target, data, out, *partitioned)], script=FAULTS)
    assert killed.returncode != 0 and "Traceback" not in killed.stderr, killed.stderr[-3000:]
    assert "error: rank 0: stopped because another rank failed" in killed.stderr, killed.stderr[-3000:]
    resumed = ok(run_deepspeed(tiny_train_args(target, data, out, *partitioned, "--resume")))
    assert "resumed from" in resumed.stdout and "ZeRO-3 partitioned over 2 rank(s)" in resumed.stdout
    assert "tau@1 follow them" in resumed.stdout and not (out / "eval_turns.json").exists()

    def without_target_bytes(run):
        records, samples = run
        memory = [(r.pop("target_resident_bytes", None), r.pop("target_gathered_bytes", None)) for r in records]
        for r in records:
            r.pop("tau@1", None), r.pop("tau@1_stderr", None)
        return (records, samples), memory

    (mine, memory), (theirs, full) = without_target_bytes(history(out)), without_target_bytes(history(reference))
    assert mine == theirs
    train = [(m, f) for m, f in zip(memory, full, strict=True) if m[0] is not None]
    assert all(0.5 <= r / f < 0.52 for (resident, _), (whole, _) in train for r, f in zip(resident, whole, strict=True))
    assert all(g > 0 for (_, gathered), _ in train for g in gathered)


def test_crashes_at_any_point_lose_and_repeat_no_sample(reference, tiny_run_inputs, tmp_path):
    """One run folder through three SIGKILLs and a corrupted checkpoint, then compared with
    the reference: same losses, same evaluations, same samples in every step."""
    target, data = tiny_run_inputs
    out = tmp_path / "run"

    def crash(fault, *extra):
        proc = run_deepspeed([fault, *tiny_train_args(target, data, out, *COMMON, *extra)], script=FAULTS)
        assert proc.returncode != 0, f"{fault} did not stop the run"
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]  # a dead peer is one line on every rank
        return proc

    # one rank dies between backward and optimizer step; rank 0, in the step's collective, says so
    # (before the launcher's rule stops it too; the later crashes are about the files)
    assert "error: rank 0: stopped because another rank failed" in crash("kill-mid-step@3:1").stderr
    assert complete_checkpoints(out) == ["step-00000002"]
    crash("kill-mid-save@4:all", "--resume")  # every rank dies while writing its files
    assert complete_checkpoints(out) == ["step-00000002"]
    assert (out / "checkpoints" / "step-00000004").is_dir(), "the partial save is there, and ignored"
    crash("kill-before-marker@6:0", "--resume")  # all files written, COMPLETE not yet
    assert complete_checkpoints(out) == ["step-00000002", "step-00000004"]
    # the newest complete checkpoint is damaged: the resume falls back to the previous one
    states = out / "checkpoints" / "step-00000004" / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[:100])
    final = ok(run_deepspeed(tiny_train_args(target, data, out, *COMMON, "--resume")))
    assert "step-00000004 cannot be loaded" in final.stderr and "falling back" in final.stderr
    assert "at step 2 (epoch 0" in final.stdout
    assert history(out) == history(reference)


def test_non_finite_steps_are_skipped_then_the_run_stops_with_the_last_good_weights(tiny_run_inputs, tmp_path):
    target, data = tiny_run_inputs
    out = tmp_path / "run"
    proc = run_deepspeed(["nan@3-4", *tiny_train_args(target, data, out, *COMMON, "--max-nonfinite-steps", 2)],
                         script=FAULTS)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "steps 3-4: 2 optimizer steps in a row had non-finite loss or gradients" in proc.stderr
    assert "Traceback" not in proc.stderr
    train = read_metrics(out)
    assert [(r["step"], r["step_applied"], r["loss"] is None) for r in train] == [
        (1, True, False), (2, True, False), (3, False, True), (4, False, True)]
    assert train[-1]["nonfinite_steps"] == 2
    assert complete_checkpoints(out) == ["step-00000002", "step-00000004"]

    def weights(tag):
        path = out / "checkpoints" / tag / "mp_rank_00_model_states.pt"
        return torch.load(path, map_location="cpu", weights_only=False)["module"]

    good, stopped = weights("step-00000002"), weights("step-00000004")
    assert good.keys() == stopped.keys()
    assert all(torch.equal(good[k], stopped[k]) for k in good), "skipped steps changed no weight"


def test_resume_with_other_world_size_or_step_size_is_refused_unless_forced(reference, tiny_run_inputs, tmp_path):
    target, data = tiny_run_inputs
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    # one rank: `python launch/train.py` (the launcher is the same for one rank and costs a launch)
    proc = train_one_rank(*tiny_train_args(target, data, out, *COMMON, "--resume"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "world_size: checkpoint 2 -> now 1" in proc.stderr and "--force-resume" in proc.stderr
    proc = run_deepspeed(tiny_train_args(target, data, out, *COMMON, "--resume", "--step-tokens", 700))
    assert proc.returncode == 2 and "step_tokens: checkpoint 600 -> now 700" in proc.stderr
    # forced: one more epoch on one rank, from the weights of the two-rank run
    proc = ok(train_one_rank(*tiny_train_args(target, data, out, *COMMON, "--resume", "--force-resume",
                                              "--epochs", 3)))
    assert "the optimizer state (AdamW moments) starts fresh" in proc.stdout
    steps = [r["step"] for r in read_metrics(out)]
    assert steps[:8] == list(range(1, 9)) and len(steps) > 8


def test_a_resume_with_options_that_shape_another_drafter_is_refused_before_anything_loads(reference,
                                                                                          tiny_run_inputs, tmp_path):
    from ..runs import make_tiny_target

    target, data = tiny_run_inputs
    other = make_tiny_target(tmp_path / "other", seed=1)  # the same architecture, other weights
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = (out / "config.json").read_bytes()
    proc = train_one_rank(*tiny_train_args(other, data, out, *COMMON, "--resume", "--force-resume", "--gamma", 3,
                                           "--target-layer-ids", "1,2", "--draft-layers", 2))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (f"error: --resume: {out / 'checkpoints' / 'step-00000008'} trained a drafter with other settings "
            "(checkpoint -> now):\n") in proc.stderr
    for line in ("--draft-layers: 1 -> 2", "--gamma: 7.0 -> 3.0", "--target-layer-ids: 1,1 -> 1,2",
                 f"--target: {target} -> {other}"):
        assert f"\n  {line}\n" in proc.stderr, line
    assert "Loading weights" not in proc.stdout + proc.stderr, "refused before the target loads"
    assert (out / "config.json").read_bytes() == before


# ---- bad input -------------------------------------------------------------------------------
BAD_DS_CONFIGS = [
    ({"zero_optimisation": {"stage": 2}}, "unknown key 'zero_optimisation' (did you mean 'zero_optimization'?)"),
    ({"wibble": 1}, "unknown key 'wibble' (DeepSpeed would silently ignore it)"),
    ({"zero_optimization": {"stage": 2, "overlap_comms": True}}, "zero_optimization.overlap_comms: Extra inputs"),
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage: Input should be"),
    ({"zero_optimization": {"stage": 0}}, "ZeRO stage 0 is not supported"),
    ({"gradient_clipping": "high"}, "'gradient_clipping' must be a number"),
    ({"bf16": {"enabled": "yes"}}, "'bf16' must be an object with 'enabled': true/false"),
    ({"optimizer": {"type": "Adam"}}, "remove 'optimizer'/'scheduler'"),
]


@pytest.mark.parametrize("change,message", BAD_DS_CONFIGS, ids=[m[:30] for _, m in BAD_DS_CONFIGS])
def test_bad_deepspeed_config_names_the_key(tmp_path, change, message):
    config = {**json.loads((ROOT / "ds_configs" / "zero2.json").read_text()), **change}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(UserError) as err:
        load_ds_config(path, world_size=2, grad_clip=1.0, bf16=False)
    assert str(path) in str(err.value) and message in str(err.value)


@pytest.mark.parametrize("case", ["missing data", "missing target", "layers", "vocabulary", "over budget",
                                  "no tokenizer"])
def test_bad_training_input_is_a_clear_error_without_traceback(case, tiny_run_inputs, tiny_store, tmp_path):
    target, data = tiny_run_inputs
    flags = {"--target": target, "--data": tiny_store, "--output-dir": tmp_path / "run"}
    if case == "missing data":
        flags["--data"], message = tmp_path / "nope.jsonl", f"--data {tmp_path / 'nope.jsonl'}: no such file"
    elif case == "missing target":
        flags["--target"] = tmp_path / "nope"
        message = f"--target {tmp_path / 'nope'}: no such folder or file, and not a Hugging Face Hub id"
    elif case == "no tokenizer":  # transformers would load an empty tokenizer, and the mask token get id 1
        flags["--target"] = tmp_path / "bare"
        shutil.copytree(target, flags["--target"], ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
        message = f"--target {tmp_path / 'bare'}: no tokenizer files there"
    elif case == "layers":
        flags["--target-layer-ids"], message = "1,9", "out of range"
    elif case == "over budget":
        from dflash.data.token_store import TokenStore

        store = TokenStore(tiny_store)
        i = int(np.flatnonzero(store.lengths > 64)[0])
        line = store.dataset[i]["source_line"]
        flags["--token-budget"] = 64
        message = f"sample {i} (line {line} of {data}) has {store.lengths[i]} tokens, more than --token-budget 64"
    else:  # a store tokenized with the demo's 512-token vocabulary, for a target with 128 embedding rows
        from dflash.data import prepare_jsonl
        from dflash.demo import DATA, TARGET

        lines = DATA.read_text().splitlines()[:20]
        (tmp_path / "demo.jsonl").write_text("\n".join(lines) + "\n")
        prepare_jsonl(tmp_path / "demo.jsonl", str(TARGET), tmp_path / "store", progress=False)
        flags["--data"], message = tmp_path / "store", "prepare the data with the target's tokenizer"
    proc = train_one_rank(*[x for kv in flags.items() for x in kv], "--no-progress", "--num-workers", 0)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr


# ---- a run folder and its data belong to one run (issue 13) -----------------------------------------
def test_a_used_run_folder_is_refused_a_changed_resume_touches_nothing_and_overwrite_starts_over(
        tiny_run_inputs, tmp_path):
    target, data = tiny_run_inputs
    out = tmp_path / "run"
    mine = tmp_path / "data.jsonl"
    shutil.copy(data, mine)
    args = ["--target", target, "--data", mine, "--output-dir", out, "--token-budget", 1024, "--step-tokens", 1500,
            "--num-anchors", 8, "--draft-layers", 1, "--num-target-features", 2, "--max-steps", 2,
            "--no-progress", "--num-workers", 0, "--dtype", "fp32", "--no-export"]
    ok(train_one_rank(*args))  # without the launcher: one rank on the CPU
    state = {p: p.read_bytes() for p in [out / "config.json", out / "metrics.jsonl", *(out / "data").iterdir()]}

    fresh = train_one_rank(*args)
    assert fresh.returncode == 2 and "Traceback" not in fresh.stderr
    assert f"--output-dir {out}: holds a previous run (config.json, metrics.jsonl, " in fresh.stderr
    # the data file edited in place: a resume must not train on the old store, nor replace it
    lines = mine.read_text().splitlines()
    mine.write_text("\n".join(lines[:-5]) + "\n")
    resume = train_one_rank(*args, "--resume", "--max-steps", 3)
    assert resume.returncode == 2 and "Traceback" not in resume.stderr
    assert "--resume: the run's token store" in resume.stderr and f"input: {mine} changed" in resume.stderr
    assert {p: p.read_bytes() for p in state} == state, "config, metrics and the store are untouched"

    over = ok(train_one_rank(*args, "--overwrite"))
    assert f"rebuilding {out / 'data'}: input: {mine} changed" in over.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2], "the old run's records are gone, not mixed in"
    assert complete_checkpoints(out) == ["step-00000002"]


def test_an_error_in_rank_0_preparation_is_one_line_on_every_rank(tiny_run_inputs, tmp_path):
    target, data = tiny_run_inputs
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text().splitlines()[0] + "\n{oops\n")
    proc = run_deepspeed(tiny_train_args(target, bad, tmp_path / "run", "--no-export"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 2, proc.stderr[-3000:]
    assert any(f"error: {bad}:2: invalid JSON" in line for line in errors)
    assert any("error: rank 1: stopped because rank 0 failed while preparing the data" in line for line in errors)


# ---- signals: a stopped launcher stops every rank, and the run resumes (issue 28) ---------------
def launch(args, out, name):
    """`deepspeed --num_gpus 2 fault_script.py ...` in its own session (as a terminal's job), logs in files."""
    from dflash.distributed.ranks import free_port

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    logs = open(out.parent / f"{name}.log", "w+")
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), str(FAULTS), *map(str, args)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logs, stderr=subprocess.STDOUT, start_new_session=True), logs


def stop(proc, logs, out, how):
    """Wait until rank 0 waits at its step, signal the launcher as `how` says, and return the log once
    every process of the job has ended."""
    waiting = out / "waiting"
    deadline = time.time() + 300
    while not waiting.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert waiting.exists(), open(logs.name).read()[-3000:]
    waiting.unlink()
    if how == "ctrl-c":  # a terminal sends SIGINT to every process of the job
        os.killpg(proc.pid, signal.SIGINT)
    else:  # `kill PID` of the deepspeed command alone
        proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            os.killpg(proc.pid, 0)  # a process of the job is still there: an orphaned rank?
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("a rank outlived its launcher:\n" + open(logs.name).read()[-3000:])
    logs.seek(0)
    return logs.read()


def rank_tracebacks(log: str) -> list[str]:
    """Tracebacks in a job's log other than the `deepspeed` command's own KeyboardInterrupt on Ctrl-C
    (DeepSpeed's runner handles no SIGINT)."""
    lines = log.splitlines()
    return [lines[i + 1] for i, line in enumerate(lines[:-1])
            if line.startswith("Traceback") and not lines[i + 1].strip().endswith("/deepspeed\", line 6, in <module>")]


def test_a_stopped_launcher_stops_every_rank_in_one_line_and_the_run_resumes_once(reference, tiny_run_inputs,
                                                                                   tmp_path):
    target, data = tiny_run_inputs
    out = tmp_path / "run"
    # Ctrl-C in step 2, before the first checkpoint: rank 1 waits in a collective for rank 0
    log = stop(*launch(["wait@2:0", *tiny_train_args(target, data, out, *COMMON)], out, "first"), out, "ctrl-c")
    errors = [line for line in log.splitlines() if "error:" in line]
    assert sorted(errors) == ["error: rank 1: stopped by SIGINT", "error: stopped by SIGINT; no checkpoint was written "
                              "yet: the same command with --resume starts the run again"], log[-3000:]
    assert rank_tracebacks(log) == []
    # SIGTERM to the deepspeed command alone (it forwards nothing): the ranks see it gone and stop
    log = stop(*launch(["wait@5:0", *tiny_train_args(target, data, out, *COMMON, "--resume")], out, "second"), out,
               "kill")
    errors = [line for line in log.splitlines() if "error:" in line]
    assert f"error: stopped by SIGTERM (its launcher was stopped); the newest complete checkpoint is " \
           f"{out / 'checkpoints' / 'step-00000004'}: continue from it with the same command and --resume" in errors
    assert rank_tracebacks(log) == [] and len(errors) == 2, log[-3000:]
    from dflash.distributed.run_folder import RunFolder

    folder = RunFolder(out)
    folder.lock()  # the stopped run released it
    folder.release()
    ok(run_deepspeed(tiny_train_args(target, data, out, *COMMON, "--resume")))
    assert history(out) == history(reference), "every record once, every sample once per epoch"
