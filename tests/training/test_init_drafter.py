"""--init-drafter: a drafter in the official format (ours or released) sets the drafter options,
checked against the target before anything loads."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from dflash.errors import UserError
from dflash.models import DFlashDrafter, DrafterConfig
from dflash.testing import train_in_process
from dflash.training.config import load_config

from ..runs import released_drafter

S, F = "sliding_attention", "full_attention"


def test_the_drafter_sets_the_drafter_options(tmp_path):
    folder = released_drafter(tmp_path / "drafter")
    c = load_config(["--init-drafter", str(folder)])
    d = c.drafter
    assert (d.block_size, d.draft_layers, d.target_layer_ids, d.num_target_features) == (8, 3, (1, 3), 2)
    assert (c.drafter.drafter_layer_types, c.drafter.sliding_window, c.loss.gamma) == ((S, S, F), 4, 4.0)
    # Options that agree with the drafter may be given; short type names count as the full ones.
    same = load_config(["--init-drafter", str(folder), "--block-size", "8", "--drafter-layer-types", "sliding,sliding,"
                        "full", "--sliding-window", "4"])
    assert same == c


@pytest.mark.parametrize("argv,message", [
    (["--block-size", "16"], "--block-size 16 contradicts --init-drafter {folder}, whose value is 8 (leave "
                             "--block-size out)"),
    (["--drafter-layer-types", "full,full,full"], "--drafter-layer-types ('full_attention', 'full_attention', "
     "'full_attention') contradicts --init-drafter {folder}, whose value is ('sliding_attention', 'sliding_attention', "
     "'full_attention') (leave --drafter-layer-types out)"),
    (["--mask-token", "<|x|>"], "--mask-token '<|x|>' contradicts --init-drafter {folder}: the drafter's "
                                "dflash_config.mask_token_id is its mask token (leave --mask-token out)"),
])
def test_options_that_contradict_the_drafter_are_refused(tmp_path, argv, message):
    folder = released_drafter(tmp_path / "drafter")
    with pytest.raises(UserError) as err:
        load_config(["--init-drafter", str(folder), *argv])
    assert str(err.value) == message.format(folder=folder)


@pytest.mark.parametrize("change,message", [
    ({"hidden_size": 64}, "hidden_size is 64, the target's is 128"),
    ({"vocab_size": 600}, "vocab_size is 600, the target's embedding has 512 rows"),
    ({"num_target_layers": 36}, "num_target_layers is 36 (the target it was trained on), this target has 6 layers"),
    ({"dflash_config": {"mask_token_id": 511, "target_layer_ids": [1, 5]}},
     "dflash_config.target_layer_ids: target layer id 5 is out of range"),
    ({"use_sliding_window": False}, "use_sliding_window is not true"),
])
def test_a_drafter_that_does_not_fit_the_target_is_refused_naming_the_field(tmp_path, change, message):
    folder = released_drafter(tmp_path / "drafter", **change)
    with pytest.raises(UserError) as err:
        load_config(["--init-drafter", str(folder)])
    assert str(err.value).startswith(f"--init-drafter {folder / 'config.json'}") and message in str(err.value)


def test_num_target_layers_may_be_absent(tmp_path):
    """Drafters written by others may leave num_target_layers out: only the taps are checked."""
    folder = released_drafter(tmp_path / "drafter")
    config = json.loads((folder / "config.json").read_text())
    del config["num_target_layers"]
    (folder / "config.json").write_text(json.dumps(config))
    assert load_config(["--init-drafter", str(folder)]).drafter.target_layer_ids == (1, 3)


@pytest.mark.slow
def test_a_released_sliding_drafter_continues_training(tiny_run_inputs, tmp_path):
    """A drafter written by others (bf16 tensors, torch_dtype, rope_theta, sliding layers) starts a
    run: its weights are the run's initial weights (a learning rate too small to move them leaves
    the export equal to them), its layer types, window, taps and mask token are the run's."""
    from safetensors.torch import load_file

    from ..runs import read_metrics, run_deepspeed, tiny_train_args

    target, data = tiny_run_inputs
    hf = json.loads((target / "config.json").read_text())
    config = DrafterConfig.from_target(type("T", (), {**hf, "rope_parameters": {"rope_type": "default",
                                                                               "rope_theta": 1e6}}),
                                       mask_token_id=hf["vocab_size"] - 1, block_size=8, draft_layers=2,
                                       target_layer_ids=[0, 1], layer_types=[S, F], sliding_window=5)
    folder = tmp_path / "released"
    folder.mkdir()
    torch.manual_seed(3)
    weights = {k: v.to(torch.bfloat16) for k, v in DFlashDrafter(config).state_dict().items()}
    save_file(weights, folder / "model.safetensors")
    written = config.to_json_dict()
    written["torch_dtype"] = written.pop("dtype")
    written.pop("rope_parameters")
    del written["num_target_layers"]  # released configs may leave it out (the taps alone suggest 3, not 4)
    (folder / "config.json").write_text(json.dumps(written))

    out = tmp_path / "run"
    args = tiny_train_args(target, data, out, "--init-drafter", folder, "--max-steps", 2, "--lr", 1e-9)
    for flag in ("--draft-layers", "--num-target-features"):  # taken from the drafter
        i = args.index(flag)
        del args[i:i + 2]
    train_in_process(args)
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    exported = json.loads((out / "drafter" / "config.json").read_text())
    assert exported["layer_types"] == [S, F] and exported["sliding_window"] == 5
    assert exported["use_sliding_window"] is True and exported["block_size"] == 8
    assert exported["dflash_config"] == {"mask_token_id": hf["vocab_size"] - 1, "target_layer_ids": [0, 1],
                                         # stated for the engines (dflash.drafter.serving)
                                         "use_swa": False, "swa_window_size": 5, "attention_sink_bias": False}
    assert exported["num_target_layers"] == hf["num_hidden_layers"]
    trained = load_file(out / "drafter" / "model.safetensors")
    assert trained.keys() == weights.keys()
    for name, w in weights.items():
        torch.testing.assert_close(trained[name].float(), w.float(), rtol=0, atol=1e-5, msg=name)

    # Resumed without --init-drafter but with its every option, the run would add a mask token of
    # its own and train (and export) another id: the checkpoint records the id, and the resume is
    # refused once the target gives it, before the drafter loads; the export stays as it was.
    exported_before = (out / "drafter" / "config.json").read_bytes()
    args = tiny_train_args(target, data, out, "--max-steps", 2, "--lr", 1e-9, "--resume", "--draft-layers", 2,
                           "--block-size", 8, "--target-layer-ids", "0,1", "--drafter-layer-types", "sliding,full",
                           "--sliding-window", 5)
    i = args.index("--draft-layers")
    del args[i:i + 2]  # tiny_train_args' own
    proc = run_deepspeed(args, num_ranks=1)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(rf"\n  mask token id: {hf['vocab_size'] - 1} -> \d+\n", proc.stderr), proc.stderr[-3000:]
    assert "a run started with --init-drafter resumes with it" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (out / "drafter" / "config.json").read_bytes() == exported_before


def test_resume_refuses_a_checkpoint_trained_with_other_layer_types():
    """The weights have the same shapes whatever mask a layer trains with, so the checkpoint's
    record of the drafter settings names the layer types and the window (`--resume` compares it)."""
    from dflash.training.checkpoint import drafter_differences
    from dflash.training.plan import drafter_settings, resolve_run

    full = load_config(["--data", "d.jsonl", "--draft-layers", "2"])
    sliding = load_config(["--data", "d.jsonl", "--draft-layers", "2", "--drafter-layer-types", "sliding,full",
                           "--sliding-window", "64"])
    assert drafter_differences(drafter_settings(resolve_run(full), 6), drafter_settings(resolve_run(sliding), 6)) == [
        "--drafter-layer-types: full -> sliding_attention,full_attention", "--sliding-window: 0 -> 64"]
    explicit_full = load_config(["--data", "d.jsonl", "--draft-layers", "2", "--drafter-layer-types", "full,full"])
    assert drafter_differences(drafter_settings(resolve_run(full), 6),
                               drafter_settings(resolve_run(explicit_full), 6)) == []


def test_overwrite_never_deletes_what_the_run_reads(tmp_path):
    """`--init-drafter RUN/drafter --output-dir RUN --overwrite`: the drafter to start from is the
    previous run's export, which --overwrite would delete; refused naming both, nothing deleted."""
    from types import SimpleNamespace

    from dflash.distributed.run_folder import RunFolder
    from dflash.partial import mark_folder
    from dflash.training.checkpoint import Checkpointer
    from dflash.training.trainer import Trainer

    run = tmp_path / "run"
    folder = released_drafter(run / "drafter")
    (run / "metrics.jsonl").write_text("{}\n")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    cfg = load_config(["--init-drafter", str(folder), "--output-dir", str(run), "--overwrite"])
    trainer = SimpleNamespace(cfg=cfg, run_folder=RunFolder(run), checkpointer=Checkpointer(run, keep=1),
                              drafter_settings={})
    with pytest.raises(UserError) as err:
        Trainer._claim(trainer)
    assert str(err.value) == (f"--output-dir {run}: holds --init-drafter {folder}, which this command reads; what "
                              "dflash writes stays apart from what it reads: choose another --output-dir")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert (run / "metrics.jsonl").is_file(), "a refused overwrite deletes nothing"
    mark_folder(run, "launch/train.py")  # a run's folder: only the lock could refuse a resume
    RunFolder(run).claim(resume=True, overwrite=False)  # the lock was released
