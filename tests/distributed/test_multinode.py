"""Multi-node runs on one machine: two DeepSpeed launchers (`--hostfile H --no_ssh --node_rank 0|1`),
one CPU rank per node, as a user starts them on two nodes without ssh.

A 2-node run must equal a 2-rank single-node run of the same seed, through a checkpoint and a
resume, down to the exported weights; a node that does not see the run folder or the data must
stop both nodes at once with a message that names the path.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from dflash.distributed.ranks import free_port
from dflash.distributed.shared_fs import PROBE, check_shared_paths
from dflash.errors import UserError

from ..conftest import ROOT
from ..runs import read_metrics, run_deepspeed, tiny_train_args, with_turn_limit, without_timings

# ZeRO-3, micro-batches dealt by cost (the default): 3 steps in epoch 0; the multi-node run stops after
# step 2 (inside epoch 0) and resumes
COMMON = ("--step-tokens", 600, "--max-steps", 5, "--deepspeed_config", ROOT / "ds_configs" / "zero3.json")


def two_nodes(args, tmp_path, cwds=(ROOT, ROOT), timeout=600):
    """Node 0 and node 1 of a hostfile, each its own `deepspeed --no_ssh` launcher with one CPU rank,
    run from `cwds`; returns [(exit status, stdout, stderr)] per node."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    port = str(free_port())
    logs, procs = [], []
    for node, cwd in enumerate(cwds):
        logs.append((open(tmp_path / f"node{node}.out", "w+"), open(tmp_path / f"node{node}.err", "w+")))
        cmd = [launcher, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), "--master_addr",
               "127.0.0.1", "--master_port", port, str(ROOT / "launch" / "train.py"), *map(str, args)]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=logs[-1][0], stderr=logs[-1][1],
                                      start_new_session=True))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:  # a hung node: end its launcher and ranks (its own process group)
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    results = []
    for p, (out, err) in zip(procs, logs, strict=True):
        out.seek(0), err.seek(0)
        results.append((p.returncode, out.read(), err.read()))
        out.close(), err.close()
    return results


def ok(results):
    for node, (code, out, err) in enumerate(results):
        assert code == 0, f"node {node}:\n" + out[-3000:] + err[-3000:]
    return results


def history(out):
    """The metric records without timings (step and per-rank seconds, tokens/s)."""
    with open(out / "metrics.jsonl") as f:
        return [without_timings(json.loads(line)) for line in f]


@pytest.mark.slow
def test_two_nodes_checkpoint_resume_and_export_like_one_node_then_resume_on_one_rank(tiny_run_inputs, tmp_path):
    target, data = tiny_run_inputs
    data = with_turn_limit(data, tmp_path / "data.jsonl")  # the held-out turns sampled at 1 stop at TURN_LIMIT
    one = tmp_path / "one"
    proc = run_deepspeed(tiny_train_args(target, data, one, *COMMON))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    two = tmp_path / "two"  # JSONL data: prepared by rank 0 into the run folder that node 1 reads too
    first = ok(two_nodes(tiny_train_args(target, data, two, *COMMON, "--stop-at-step", 2), tmp_path))
    for node, (_, out, err) in enumerate(first):
        assert f"nnodes=2, num_local_procs=1, node_rank={node}" in out + err, "two launchers, one rank each"
    assert "dflash: 2 rank(s)" in first[0][1] and [r["step"] for r in read_metrics(two)] == [1, 2]
    checkpoint = two / "checkpoints" / "step-00000002"
    assert (checkpoint / "COMPLETE").is_file()
    assert {p.name for p in checkpoint.glob("zero_pp_rank_*_optim_states.pt")} == {
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"}, \
        "each node's rank wrote its ZeRO-3 shard"
    assert not (two / "drafter").exists()

    second = ok(two_nodes(tiny_train_args(target, data, two, *COMMON, "--resume"), tmp_path))
    assert "at step 2 (epoch 0" in second[0][1], "resumed inside the epoch"
    assert [r["step"] for r in read_metrics(two)] == [1, 2, 3, 4, 5]
    assert history(two) == history(one), "same losses, tau, lr, grad norms and evaluations"
    mine, theirs = load_file(two / "drafter" / "model.safetensors"), load_file(one / "drafter" / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert (two / "drafter" / "config.json").read_text() == (one / "drafter" / "config.json").read_text()

    # the same run on one node with one rank: ZeRO-3 shards cannot be re-partitioned, the weights alone load
    fewer = tmp_path / "fewer"
    shutil.copytree(two, fewer, ignore=shutil.ignore_patterns("drafter"))
    proc = run_deepspeed(tiny_train_args(target, data, fewer, *COMMON, "--resume", "--force-resume"), num_ranks=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 -> 1 ranks: the weights are loaded" in proc.stdout and "at step 5 " in proc.stdout
    loaded = load_file(fewer / "drafter" / "model.safetensors")  # no step left to train: exported as loaded
    assert loaded.keys() == mine.keys() and all(torch.equal(loaded[k], mine[k]) for k in mine)


@pytest.mark.slow
def test_a_node_that_does_not_see_the_run_folder_or_data_stops_every_node_at_once(tiny_run_inputs, tmp_path):
    """Relative paths from two working folders: the same path names different folders on the two
    'nodes', as on nodes without a shared filesystem."""
    target, data = tiny_run_inputs
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for folder in nodes:
        folder.mkdir()
    shutil.copy(data, nodes[0] / "data.jsonl")  # only node 0 has the data
    args = tiny_train_args(target, "data.jsonl", "run", "--deepspeed_config", ROOT / "ds_configs" / "zero3.json")
    results = two_nodes(args, tmp_path, cwds=nodes, timeout=300)
    host = socket.gethostname()
    for node, (code, out, err) in enumerate(results):
        assert code == 2, f"node {node}:\n" + out[-3000:] + err[-3000:]
        assert f"--output-dir run: the file rank 0 ({host}) wrote there ({PROBE}) is not seen by rank 1 on {host}" \
            in err and "filesystem that every node shares" in err
        assert f"--data data.jsonl: not found by rank 1 on {host}; found by rank 0 on {host}" in err
        assert "Traceback" not in err
    assert not (nodes[0] / "run" / PROBE).exists() and not (nodes[0] / "run" / "data").exists(), "before any work"


def _check_from(rank, folders, port, results):
    """A rank of a 2-process gloo group whose working folder stands for its node's filesystem."""
    os.chdir(folders[rank])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    outcomes = []
    for inputs in ({"--data": "data.jsonl", "--target": "target"}, {"--data": "other.jsonl"}, {"--data": "nowhere"}):
        try:
            check_shared_paths(folders[0] / "run", {flag: Path(p) for flag, p in inputs.items()})
            outcomes.append(None)
        except UserError as err:
            outcomes.append(str(err))
    results[rank] = outcomes
    dist.destroy_process_group()


@pytest.mark.slow
def test_inputs_must_be_the_same_on_every_node(tmp_path):
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for i, folder in enumerate(folders):
        (folder / "target").mkdir(parents=True)
        (folder / "target" / "config.json").write_text("{}")  # identical copies of a folder: fine
        (folder / "data.jsonl").write_text("{}\n")  # identical copies of a file: fine
        (folder / "other.jsonl").write_text("{}\n" * (i + 1))  # another file at the same path
    results = mp.Manager().dict()
    mp.spawn(_check_from, args=(folders, free_port(), results), nprocs=2)
    host = socket.gethostname()
    for rank in (0, 1):
        same, other, nowhere = results[rank]
        assert same is None and nowhere is None, "nowhere: left to the usual 'no such file' error"
        assert f"--data other.jsonl: rank 0 ({host}) sees a file of 3 bytes; rank 1 on {host}: different contents" \
            in other and "the same copy on each node" in other


def test_each_rank_takes_its_node_local_device_before_anything_runs_on_it(monkeypatch):
    """On a node of 8 GPUs, rank r must work on GPU LOCAL_RANK: DeepSpeed selects it only inside
    deepspeed.initialize, after the target is loaded and the first collectives ran."""
    import deepspeed
    import deepspeed.accelerator

    from dflash.distributed import process_group

    calls = []

    class Accelerator:
        def set_device(self, index):
            calls.append(("set_device", index))

        def device_name(self):
            return "cuda"

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", Accelerator)
    monkeypatch.setattr(deepspeed, "init_distributed", lambda: calls.append("init_distributed"))
    process_group.init_distributed()
    assert calls == [("set_device", 3), "init_distributed"]
