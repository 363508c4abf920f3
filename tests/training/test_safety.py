"""Checkpoints, export and the DeepSpeed JSON under faults, in-process on one gloo rank: a lost
or cut checkpoint file is named, a full disk is one clear error, the export is all or nothing."""
import errno
import json
import os
import re
import warnings

import pytest
import torch

from dflash import testing
from dflash.errors import UserError
from dflash.target.spec import load_target_spec
from dflash.training.checkpoint import Checkpointer
from dflash.training.ds_config import load_ds_config, precision

from ..conftest import ROOT, launch_script
from ..drafter.checkpoint_helpers import make_drafter


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo process group, as the trainer has under the launcher (a CLI main tested here exits
    through exit_with_error, which takes it down: `testing.one_rank` destroys only a group still there)."""
    with testing.one_rank():
        yield


class FileEngine:
    """The two DeepSpeed engine calls the Checkpointer makes, on a file per rank and a shared one."""

    device = torch.device("cpu")

    def __init__(self, fail=None):
        self.fail, self.loaded = fail, None

    def save_checkpoint(self, root, tag, save_latest):
        os.makedirs(os.path.join(root, tag))
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            if self.fail == name:
                raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 3776 vs 3664")
            torch.save({"tag": tag}, os.path.join(root, tag, name))

    def load_checkpoint(self, root, tag, **kwargs):
        self.loaded = torch.load(os.path.join(root, tag, "mp_rank_00_model_states.pt"))["tag"]
        return tag, {}


def saved(tmp_path, steps):
    ckpt = Checkpointer(tmp_path, keep=5)
    for step in steps:
        ckpt.save(FileEngine(), {"step": step, "planner": {}})
    return ckpt


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_lost_or_cut_checkpoint_file_is_named_and_the_previous_one_loaded(one_rank, tmp_path, damage):
    ckpt = saved(tmp_path, [2, 4])
    optim = ckpt.root / "step-00000004" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    size = optim.stat().st_size
    if damage == "deleted":
        optim.unlink()
        reason = f"missing file {optim}"
    else:
        optim.write_bytes(optim.read_bytes()[:10])
        reason = f"file {optim} has 10 bytes, {size} were written"
    engine = FileEngine()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = ckpt.load_latest(engine, check=lambda state: None)
    assert engine.loaded == "step-00000002" and state["step"] == 2 and "files" not in state
    assert any(reason in str(w.message) and "falling back" in str(w.message) for w in caught)


def test_full_disk_during_a_save_is_one_clear_error_and_keeps_the_previous_checkpoint(one_rank, tmp_path):
    ckpt = saved(tmp_path, [2])
    with pytest.raises(UserError) as err:
        ckpt.save(FileEngine(fail="zero_pp_rank_0_mp_rank_00_optim_states.pt"), {"step": 4, "planner": {}})
    message = str(err.value)
    assert message.startswith(f"checkpoint {ckpt.root / 'step-00000004'}: the disk is full (")
    assert "step-00000002 is the newest complete checkpoint" in message and "--resume" in message
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["step-00000002"], "the partial save is removed"


def test_other_save_errors_are_not_taken_for_a_full_disk(one_rank, tmp_path):
    class Broken(FileEngine):
        def save_checkpoint(self, root, tag, save_latest):
            raise RuntimeError("CUDA error: an illegal memory access")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        Checkpointer(tmp_path, keep=2).save(Broken(), {"step": 2, "planner": {}})


def test_export_refuses_non_finite_weights_and_leaves_nothing(tmp_path):
    drafter = make_drafter(num_layers=1, taps=(1,))
    with torch.no_grad():
        drafter.fc.weight[0, 0] = float("nan")
        drafter.norm.weight[0] = float("inf")
    message = r"not exported: 2 of \d+ weight tensors hold NaN or inf \(fc.weight, norm"
    with pytest.raises(UserError, match=message) as e:
        drafter.save_pretrained(tmp_path / "drafter")
    assert "--lr" not in str(e.value), "the library names no flags; the trainer adds the advice"
    assert list(tmp_path.iterdir()) == []


def test_export_is_all_or_nothing_and_replaces_only_a_drafter(tmp_path, monkeypatch):
    import safetensors.torch

    from dflash.models import DFlashDrafter

    out = tmp_path / "drafter"
    first = make_drafter(num_layers=1, taps=(1,))
    first.save_pretrained(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail(*args, **kwargs):  # what safetensors raises on a full disk
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    second = make_drafter(num_layers=2, taps=(1, 3))
    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", fail)
        with pytest.raises(UserError, match=rf"{out}: not exported: the disk is full \(.* free\); nothing was "
                                            "written and the previous export is unchanged"):
            second.save_pretrained(out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "the old export is intact"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"], "no temporary folder left"
    second.save_pretrained(out)
    assert DFlashDrafter.from_pretrained(out).config.num_hidden_layers == 2
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(UserError, match="is not a drafter folder .*; not replaced"):
        second.save_pretrained(mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_tuner_names_its_own_flag_for_a_bad_base(tmp_path, capsys):
    module = launch_script("tune_ds_config")
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"zero_optimization": {"stage": 2}, "wibble": 1}))
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--base", str(base), "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"error: --base {base}: unknown key 'wibble'" in err
    assert "--deepspeed_config" not in err


@pytest.mark.parametrize("config,expected", [({"bf16": {"enabled": True}}, "bf16"),
                                             ({"fp16": {"enabled": True}, "bf16": {"enabled": False}}, "fp16"),
                                             ({"bf16": {"enabled": False}}, None), ({}, None)])
def test_precision_is_what_the_json_switches_on(config, expected):
    assert precision(config) == expected


def test_deepspeed_json_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_bytes(b'{"zero_optimization": {"stage": 2}, "x": "\xff"}')
    with pytest.raises(UserError, match=rf"--deepspeed_config {path}: invalid JSON at"):
        load_ds_config(path, world_size=1, grad_clip=1.0, bf16=False)


def test_a_run_folder_is_locked_and_a_used_one_refused_unless_resumed_or_overwritten(tmp_path):
    from dflash.distributed.run_folder import RunFolder

    run = tmp_path / "run"
    first = RunFolder(run)
    first.claim(resume=False, overwrite=False)
    with pytest.raises(UserError, match=rf"--output-dir {run}: another run is writing it \(process {os.getpid()}@"):
        RunFolder(run).claim(resume=False, overwrite=False)
    first.release()  # the first run ends
    for name in ("config.json", "metrics.jsonl", "samples.rank0.jsonl", "notes.txt"):
        (run / name).write_text("x")
    for name in ("checkpoints/step-00000006", "data", "drafter"):
        (run / name).mkdir(parents=True)
    (run / "drafter" / "mine.txt").write_text("not an export")
    # the user's own drafter/: no option makes it the run's (the export at the end would refuse it)
    for resume, overwrite in ((False, False), (True, False), (False, True)):
        with pytest.raises(UserError, match=rf"--output-dir {run}: {run / 'drafter'} is not a drafter exported by "
                                            "dflash, and the run exports its drafter there at the end; move or "
                                            "rename that folder"):
            RunFolder(run).claim(resume=resume, overwrite=overwrite)
    assert (run / "drafter" / "mine.txt").is_file()
    (run / "drafter").rename(run / "mine")
    make_drafter(num_layers=1, taps=(1,)).save_pretrained(run / "drafter")  # an export: part of the run
    with pytest.raises(UserError, match=r"holds a previous run \(config.json, metrics.jsonl, checkpoints, drafter, "
                                        r"samples.rank0.jsonl\); continue it with --resume"):
        RunFolder(run).claim(resume=False, overwrite=False)
    resumed = RunFolder(run)
    resumed.claim(resume=True, overwrite=False)
    resumed.release()
    assert (run / "checkpoints" / "step-00000006").is_dir(), "a resume keeps everything"
    # --overwrite deletes only in a folder that holds nothing but what runs write
    with pytest.raises(UserError, match=rf"--output-dir {run}: --overwrite deletes only what dflash wrote, and the "
                                        r"folder also holds mine, notes.txt: move those away"):
        RunFolder(run).claim(resume=False, overwrite=True)
    assert (run / "checkpoints" / "step-00000006").is_dir(), "a refused overwrite deletes nothing"
    for name in ("mine", "notes.txt"):
        (run / name).rename(tmp_path / name)
    RunFolder(run).claim(resume=False, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == [".dflash.lock", ".dflash_writer.json", "data"]


def test_overwrite_deletes_only_in_a_folder_dflash_marked_and_never_an_input(tmp_path):
    """The user's own config.json and metrics.jsonl (no mark) are a previous run to no option: refused
    naming them, deleted by nothing; --output-dir set to the target's folder is refused before anything
    is deleted (it used to delete the target's config.json)."""
    from types import SimpleNamespace

    from dflash.distributed.run_folder import RunFolder
    from dflash.training.checkpoint import Checkpointer
    from dflash.training.config import load_config
    from dflash.training.trainer import Trainer

    mine = tmp_path / "mine"
    mine.mkdir()
    files = {"config.json": b'{"lr": 1}\n', "metrics.jsonl": b'{"step": 1}\n'}
    for name, data in files.items():
        (mine / name).write_bytes(data)
    for resume, overwrite in ((False, False), (False, True), (True, False)):
        with pytest.raises(UserError) as err:
            RunFolder(mine).claim(resume=resume, overwrite=overwrite)
        assert str(err.value) == (f"--output-dir {mine}: holds config.json, metrics.jsonl, which launch/train.py "
                                  "did not write (the folder has no .dflash_writer.json of it); dflash replaces and "
                                  "deletes only what it wrote: move them away, or choose another --output-dir")
        assert "previous run" not in str(err.value)
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == files

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"model_type": "qwen3"}\n')
    for out in (target, target / "run"):
        cfg = load_config(["--target", str(target), "--output-dir", str(out), "--overwrite"])
        trainer = SimpleNamespace(cfg=cfg, run_folder=RunFolder(out), checkpointer=Checkpointer(out, keep=1),
                                  drafter_settings={})
        with pytest.raises(UserError) as err:
            Trainer._claim(trainer)
        relation = "is" if out == target else "lies inside"
        assert str(err.value) == (f"--output-dir {out}: {relation} --target {target}, which this command reads; what "
                                  "dflash writes stays apart from what it reads: choose another --output-dir")
    assert sorted(p.name for p in target.iterdir()) == ["config.json"], "nothing written, nothing deleted"


def test_an_output_dir_that_is_a_file_or_read_only_is_one_line(tmp_path, monkeypatch):
    import errno

    from dflash.distributed.run_folder import RunFolder

    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match=rf"--output-dir {tmp_path / 'file'}: exists and is not a folder"):
        RunFolder(tmp_path / "file").claim(resume=False, overwrite=False)
    mkdir = os.mkdir

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)
    with pytest.raises(UserError, match=rf"--output-dir {tmp_path / 'ro' / 'run'}: cannot create the folder "
                                        r"\(read-only file system\); choose another --output-dir"):
        RunFolder(tmp_path / "ro" / "run").claim(resume=False, overwrite=False)


def test_run_store_is_rebuilt_when_its_input_changes_and_refused_on_resume(tmp_path):
    from dflash.data.prepare import ensure_store
    from dflash.data.token_store import TokenStore

    from ..conftest import make_chat_tokenizer
    from ..data.helpers import CONVERSATIONS, write_jsonl

    tok = make_chat_tokenizer()
    src = write_jsonl(tmp_path / "train.jsonl", CONVERSATIONS)
    store, said = tmp_path / "run" / "data", []
    ensure_store(src, tok, store, max_length=64, progress=False, say=said.append)
    assert said[0].startswith("preparing") and len(TokenStore(store)) == 3
    said.clear()
    ensure_store(src, tok, store, max_length=64, progress=False, say=said.append)
    assert said == [], "fresh: reused"
    write_jsonl(src, CONVERSATIONS[:2])  # edited in place
    with pytest.raises(UserError, match=r"--resume: the run's token store .* other data or settings:\n  input: "):
        ensure_store(src, tok, store, max_length=64, refuse_changes=True, progress=False, say=said.append)
    assert len(TokenStore(store)) == 3, "a refused resume replaces nothing"
    ensure_store(src, tok, store, max_length=64, progress=False, say=said.append)
    assert said[0].startswith(f"rebuilding {store}: input: ") and len(TokenStore(store)) == 2
    # the input inside the run's store folder (e.g. --data S/data/train.jsonl --output-dir S) is never deleted
    inside = tmp_path / "S" / "data"
    inside.mkdir(parents=True)
    user = write_jsonl(inside / "train.jsonl", CONVERSATIONS)
    with pytest.raises(UserError, match=rf"the run's token store {inside}: holds --data {user}, which this command"):
        ensure_store(user, tok, inside, max_length=64, progress=False, say=said.append)
    assert [p.name for p in inside.iterdir()] == ["train.jsonl"]


def test_without_the_launcher_one_process_runs_or_the_launcher_is_named():
    from dflash.distributed.ranks import single_process_env

    env = {}
    single_process_env(env, num_gpus=1)
    assert env["RANK"] == env["LOCAL_RANK"] == "0" and env["WORLD_SIZE"] == "1" and int(env["MASTER_PORT"]) > 0
    launched = {"RANK": "3", "LOCAL_RANK": "1"}
    single_process_env(launched, num_gpus=8)
    assert launched == {"RANK": "3", "LOCAL_RANK": "1"}, "the launcher's variables are kept"
    with pytest.raises(UserError, match=r"8 GPUs: start the run with the launcher .*deepspeed --num_gpus 8"):
        single_process_env({}, num_gpus=8)


@pytest.mark.parametrize("dtype,bf16,expected", [("auto", "auto", torch.float32), ("auto", True, torch.bfloat16),
                                                  ("bf16", "auto", torch.bfloat16), ("fp32", True, "enables bf16"),
                                                  ("auto", "fp16", "fp16 is not supported")])
def test_the_run_trains_in_what_the_deepspeed_json_switches_on(tmp_path, dtype, bf16, expected):
    from dflash.training.config import load_config
    from dflash.training.ds_config import training_ds_config

    config = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    config.pop("bf16", None)
    config["fp16" if bf16 == "fp16" else "bf16"] = {"enabled": True if bf16 == "fp16" else bf16}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    cfg = load_config(["--deepspeed_config", str(path), "--dtype", dtype])

    def train_dtype():  # what the trainer calls first, before anything loads
        return training_ds_config(cfg.device.deepspeed_config, cfg.device.dtype, device="cpu", world_size=1,
                                  grad_clip=cfg.optim.grad_clip)[1]

    if isinstance(expected, str):
        with pytest.raises(UserError, match=expected):
            train_dtype()
    else:
        assert train_dtype() == expected


def test_resume_and_overwrite_contradict():
    from dflash.training.config import load_config

    with pytest.raises(UserError, match="--overwrite: contradicts --resume"):
        load_config(["--resume", "--overwrite"])


def test_a_full_disk_when_a_resume_cuts_the_metrics_back_is_one_line_and_leaves_them_as_they_were(tmp_path,
                                                                                                   monkeypatch):
    from dflash.training.metrics import trim_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"kind": "train", "step": s}) + "\n" for s in (1, 2, 3)) + '{"kind": "tr')
    before = path.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full)
        with pytest.raises(UserError, match=rf"{path}: cannot cut it back to step 2 for the resume \(the disk is full "
                                            r"\(.* free\)\); it is unchanged: free some space and --resume again"):
            trim_jsonl(path, 2)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    trim_jsonl(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_a_fault_of_the_environment_is_one_line_at_every_entry_point(capsys):
    from dflash.errors import exit_on_user_error

    @exit_on_user_error
    def main(err):
        raise err

    for err, line in [(OSError(errno.ENOSPC, "No space left on device", "/tmp/x.bin"),
                       r"error: /tmp/x.bin: the disk is full \(.* free\); free some space and run again"),
                      (RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 3776 vs 3664"),
                       r"error: the disk is full while writing a file \(RuntimeError: .*unexpected pos 3776 vs 3664\); "
                       "free some space and run again"),
                      (PermissionError(errno.EROFS, "Read-only file system", "/ro/run"),
                       r"error: /ro/run: read-only file system"),
                      (IsADirectoryError(errno.EISDIR, "Is a directory", "/tmp"),
                       r"error: /tmp: is a folder, not a file")]:
        with pytest.raises(SystemExit) as exit_info:
            main(err)
        assert exit_info.value.code == 2
        assert re.fullmatch(line + "\n", capsys.readouterr().err)
    with pytest.raises(RuntimeError, match="a bug"):  # anything else keeps its traceback
        main(RuntimeError("a bug"))


@pytest.mark.parametrize("case", ["no chat template", "no spare embedding row"])
def test_a_target_that_cannot_serve_the_run_is_refused_before_its_weights_load(tiny_run_inputs, tmp_path, case,
                                                                              monkeypatch):
    import shutil

    import transformers

    from dflash.training.config import load_config
    from dflash.training.data import chat_data
    from dflash.training.models import load_train_target

    target, data = tiny_run_inputs
    bad = tmp_path / "target"
    shutil.copytree(target, bad)
    if case == "no chat template":  # a base model's folder
        (bad / "chat_template.jinja").unlink()
        message = (f"--target {bad}: its tokenizer has no chat template, which renders the conversations of --data "
                   f"{data}; give the chat (instruct) model's folder")
    else:  # an embedding with a row per token and none spare for the mask token
        tokens = len(transformers.AutoTokenizer.from_pretrained(str(bad)))
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, "vocab_size": tokens}))
        message = (f"--target {bad}: the mask token '<|MASK|>' would get id {tokens}, but the target's embedding has "
                   f"{tokens} rows and the tokenizer {tokens} tokens: no row is spare. Either reuse a token your data "
                   "never use as the mask: train.py --mask-token TEXT")

    def loaded(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)
    cfg = load_config(["--target", str(bad), "--data", str(data)])
    with pytest.raises(UserError) as err:
        load_train_target(load_target_spec(cfg.inputs.target), torch.device("cpu"), torch.float32, cfg.drafter,
                          cfg.device, chat_data(cfg.inputs))
    assert str(err.value).startswith(message)


def test_live_children_counts_the_processes_a_parent_still_has():
    """What rank 0 counts when SIGTERM reaches it: its launcher's live ranks (a reaped one is gone)."""
    import subprocess
    import sys
    import time

    from dflash.distributed.ranks import live_children

    code = ("import subprocess, sys, time\n"
            "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']) for _ in range(3)]\n"
            "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
            "sys.stdin.readline(); kids[0].kill(); kids[0].wait()\n"  # killed and reaped, as the launcher does
            "print('reaped', flush=True); sys.stdin.readline()\n"
            "[k.kill() for k in kids[1:]]\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        parent.stdout.readline()
        time.sleep(0.5)
        assert live_children(parent.pid) == 3
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "reaped"
        assert live_children(parent.pid) == 2
        parent.stdin.write("\n")
        parent.stdin.flush()
    finally:
        parent.wait(timeout=30)


def test_a_signal_while_a_rank_exits_with_its_line_prints_nothing_more():
    """The launcher SIGTERMs every rank once one failed: one that has printed its line and is taking
    its process group down exits with its status, and the signal adds no traceback (raised, it lands
    in a finalizer that runs in that cleanup, which prints it as an ignored exception)."""
    import subprocess
    import sys

    code = ("import gc, os, signal, time\n"
            "import torch.distributed as dist\n"
            "from dflash.errors import exit_with_error\n"
            "from dflash.distributed.ranks import _on_signal, free_port\n"
            "signal.signal(signal.SIGTERM, _on_signal)\n"
            "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
            "class Bar:\n"  # a progress bar whose __del__ the signal interrupts
            "    def __del__(self):\n"
            "        os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.5)\n"
            "gc.disable(); bar = Bar(); bar.cycle = bar; del bar\n"  # finalized by the collection in the exit
            "exit_with_error('error: rank 0: stopped because another rank failed', status=2)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (2, "error: rank 0: stopped because another rank failed\n")


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=["022", "077", "002"])
def test_exported_files_are_readable_as_the_umask_says(umask, tmp_path):
    """safetensors writes model.safetensors 0600: a serving engine run as another user could not
    read the drafter beside a 0644 config.json. Every exported file gets the umask's mode."""
    import os

    old = os.umask(umask)
    try:
        make_drafter(num_layers=1, taps=(1,)).save_pretrained(tmp_path / "drafter")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "drafter").iterdir()}
    assert modes == {"config.json": 0o666 & ~umask, "model.safetensors": 0o666 & ~umask}
    assert (tmp_path / "drafter").stat().st_mode & 0o777 == 0o777 & ~umask


def test_a_second_training_on_a_taken_port_is_one_line_naming_master_port(tiny_run_inputs, tmp_path, monkeypatch):
    """`deepspeed launch/train.py` twice on one machine: the launcher's port 29500 is the first run's,
    and the second ended in a DistNetworkError (EADDRINUSE) traceback."""
    import socket

    from .. import runs as conftest

    target, data = tiny_run_inputs
    with socket.socket() as taken:  # what the first run's rank 0 holds
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(conftest, "free_port", lambda: port)
        proc = conftest.run_deepspeed(conftest.tiny_train_args(target, data, tmp_path / "run"), num_ranks=1)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: port {port} on 127.0.0.1 is taken (another run on this machine?): give this one another port, "
        "e.g. deepspeed --master_port 29501 launch/train.py ...")
