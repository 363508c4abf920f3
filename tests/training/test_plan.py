"""`plan_run`: what a run decides before anything loads, on its own (no process group, no weights),
and the sectioned configuration it reads."""
import json

import pytest
import torch
import torch.distributed as dist

from dflash.errors import UserError
from dflash.sizing.memory import GIB
from dflash.target.spec import load_target_spec
from dflash.training.config import load_config
from dflash.training.plan import plan_run, resolve_run


def test_plan_run_sizes_the_row_budget_from_the_memory_plan_alone():
    cfg = load_config(["--target", "random:qwen3-8b", "--memory-gib", "80", "--token-budget", "4096",
                       "--num-anchors", "64", "--dtype", "bf16"])
    spec = load_target_spec(cfg.inputs.target)
    ranks = dist.is_initialized()  # an in-process run before this one in the same worker may have left a group
    plan = plan_run(resolve_run(cfg, spec), device=torch.device("cpu"), world_size=8)
    assert dist.is_initialized() == ranks, "planning talks to no rank"
    rows = plan.cfg.batches.row_budget
    usable = plan.memory.usable(80 * GIB)
    # the most rows that fit: the peak at them fits in what is usable, one block of rows more does not
    assert plan.memory.peak(4096, rows)["total"] <= usable < plan.memory.peak(4096, rows + 16 * 64)["total"]
    assert cfg.batches.row_budget == 0 and plan.cfg.replace(row_budget=0) == cfg, "only the row budget is decided"
    # the target's identity hashes its weights: rank 0 adds it when it claims the run folder
    assert "--target" not in plan.drafter_settings and plan.dtype == torch.bfloat16
    assert plan.ds_config["train_micro_batch_size_per_gpu"] == 1


def test_plan_run_takes_the_released_dflash2_sizes_for_the_memory_and_the_cost_model():
    from dflash.drafter.kinds.dflash2 import released_settings

    args = ["--target", "random:qwen3-8b", "--memory-gib", "80", "--token-budget", "4096", "--num-anchors", "64"]
    spec = load_target_spec("random:qwen3-8b")
    plain = plan_run(resolve_run(load_config(args), spec), device=torch.device("cpu"), world_size=8)
    plan = plan_run(resolve_run(load_config([*args, "--drafter-kind", "dflash2"]), spec), device=torch.device("cpu"),
                    world_size=8)
    assert plain.kind_settings is None and plan.kind_settings == released_settings()
    assert (plan.memory.drafter.kind, plan.memory.drafter.kind_settings) == ("dflash2", plan.kind_settings)
    assert (plain.memory.drafter.kind, plain.memory.drafter.kind_settings) == ("dflash", None)
    assert plan.memory.drafter.params > plain.memory.drafter.params  # the convolutions and the selector priced


def test_plan_run_refuses_a_run_that_cannot_fit_naming_the_memory():
    cfg = load_config(["--target", "random:qwen3-8b", "--memory-gib", "8"])
    with pytest.raises(UserError, match=r"memory plan: this run needs about .* \(--memory-gib"):
        plan_run(resolve_run(cfg), device=torch.device("cpu"), world_size=1)


def test_a_yaml_may_group_options_by_section_and_a_misplaced_one_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-3\nbatches: {token-budget: 4096}\nseed: 3\n")
    c = load_config(["--data", "d.jsonl", "--config", str(path)])
    assert (c.optim.lr, c.batches.token_budget, c.run.seed) == (1e-3, 4096, 3)
    path.write_text("optim: {token_budget: 4096}\n")
    with pytest.raises(UserError, match=rf"--config {path}: optim.token_budget is an option of section 'batches'"):
        load_config(["--data", "d.jsonl", "--config", str(path)])
    path.write_text("optim: 3\n")
    with pytest.raises(UserError, match=rf"--config {path}: 'optim' is a section"):
        load_config(["--data", "d.jsonl", "--config", str(path)])


def _claim_resume(run, cfg, recorded_config, recorded_drafter):
    """`Trainer._claim` of `cfg` (--resume) over a run folder whose newest checkpoint recorded
    `recorded_config` (its options) and `recorded_drafter` (its drafter settings)."""
    import json
    from types import SimpleNamespace

    from dflash.distributed.run_folder import RunFolder
    from dflash.training.checkpoint import Checkpointer
    from dflash.training.plan import drafter_settings, resolve_run
    from dflash.training.trainer import Trainer

    checkpoint = run / "checkpoints" / "step-00000004"
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / "COMPLETE").write_text(json.dumps({"step": 4, "config": recorded_config, "drafter": recorded_drafter,
                                                     "files": {}}))
    spec = load_target_spec(cfg.inputs.target)
    trainer = SimpleNamespace(cfg=cfg, run_folder=RunFolder(run), checkpointer=Checkpointer(run, keep=1),
                              target_spec=spec,
                              drafter_settings=drafter_settings(resolve_run(cfg, spec), spec.num_layers))
    try:
        Trainer._claim(trainer)
    finally:
        trainer.run_folder.release()
    return checkpoint


OLD_KEYS = ("--loss", "--drafter-kind", "--optimizer", "--feature-noise", "--dpace-alpha", "--distill-temperature",
            "--selector-weight", "--selector-stop-grad")


@pytest.mark.parametrize("record", ["every value", "older dflash: defaults left out"])
def test_a_resume_compares_every_option_that_shapes_the_run_before_anything_loads(record, tmp_path):
    """`--resume` with another --loss, --drafter-kind or --optimizer used to continue (--loss) or load
    the target and then call the intact checkpoints unloadable: each is now refused naming the flag
    and both values, also against a checkpoint that recorded only what differed from the defaults
    (its recorded options fill in the rest); the schedule's options unless --force-resume."""
    from dflash.training.plan import drafter_settings, resolve_run

    base = ["--target", "random:qwen3-8b", "--data", "random", "--output-dir", str(tmp_path / "run")]
    old = load_config(base)
    recorded = drafter_settings(resolve_run(old), 36)
    if record != "every value":
        recorded = {k: v for k, v in recorded.items() if k not in OLD_KEYS}
    options = json.loads(json.dumps(old.options()))
    _claim_resume(tmp_path / "run", load_config([*base, "--resume"]), options, recorded)  # the same run resumes
    new = load_config([*base, "--resume", "--force-resume", "--loss", "kl=1,ce=1", "--drafter-kind", "dflash2",
                       "--optimizer", "muon", "--lr", "1e-3"])
    with pytest.raises(UserError) as err:
        _claim_resume(tmp_path / "run", new, options, recorded)
    lines = str(err.value).splitlines()
    assert lines[0].endswith("step-00000004 trained a drafter with other settings (checkpoint -> now):")
    for line in ("--drafter-kind: dflash -> dflash2", "--optimizer: adamw -> muon", "--loss: ce=1 -> ce=1,kl=1"):
        assert f"  {line}" in lines, (line, lines)
    lr = load_config([*base, "--resume", "--lr", "1e-3"])
    with pytest.raises(UserError) as err:
        _claim_resume(tmp_path / "run", lr, options, recorded)
    assert str(err.value).splitlines()[1:3] == ["  --lr: checkpoint 0.0006 -> now 0.001",
                                                "resume with the checkpoint's values, or add --force-resume to "
                                                "continue with these (the run then equals neither schedule)"]
    _claim_resume(tmp_path / "run", load_config([*base, "--resume", "--lr", "1e-3", "--force-resume"]), options,
                  recorded)


@pytest.mark.parametrize("sizes, error", [
    pytest.param({"hidden_size": 40}, "conv_group_size 16 does not divide hidden_size 40 (the convolution's "
                 "dynamic weights are per group of channels)", id="group size"),
    pytest.param({"vocab_size": 12}, "selector_top_k 16 exceeds the 12 vocabulary rows", id="top-k"),
])
def test_dflash2_sizes_that_do_not_fit_the_target_are_refused_naming_the_flag_before_it_loads(sizes, error,
                                                                                             tmp_path):
    """They used to be raised once the target had loaded, naming a dflash_config key no flag sets."""
    from transformers import Qwen3Config

    tiny = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32)
    Qwen3Config(**{**tiny, **sizes}).save_pretrained(tmp_path)
    cfg = load_config(["--target", f"random:{tmp_path}", "--data", "random", "--drafter-kind", "dflash2",
                       "--draft-layers", "1", "--num-target-features", "2"])
    with pytest.raises(UserError) as err:
        plan_run(resolve_run(cfg), device=torch.device("cpu"), world_size=1)
    assert str(err.value) == (f"--drafter-kind dflash2: its released sizes do not fit --target random:{tmp_path}: "
                              f"{error}; train --drafter-kind dflash on this target, or start from a DFlash2 drafter "
                              "sized for it (--init-drafter)")


@pytest.mark.parametrize("option, message", [
    (["--target-layer-ids", "1,2"], r"--target-layer-ids with --target random:.*: target layer id 2 is out of "
                                    r"range: the target has 3 layers"),
    (["--num-target-features", "2"], r"--num-target-features 2 with --target random:.*: the default tap rule needs "
                                     r"at least 4 target layers, got 3"),
])
def test_taps_the_target_cannot_give_are_refused_from_its_config(option, message, tmp_path):
    """Limits before weights: the taps are checked against config.json's depth, not by the loaded model."""
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32).save_pretrained(tmp_path)
    cfg = load_config(["--target", f"random:{tmp_path}", "--data", "random", "--memory-gib", "80", *option])
    with pytest.raises(UserError, match=message):
        plan_run(resolve_run(cfg), device=torch.device("cpu"), world_size=1)


def test_an_init_drafter_of_another_target_by_content_is_said_by_the_same_rule(tmp_path):
    """--init-drafter reads the target its export recorded (`dflash_target`) and compares it by the one
    identity rule: the same files under another path say nothing; other weights are named."""
    import shutil

    from dflash.demo import TARGET
    from dflash.training.trainer import init_drafter_note

    spec = load_target_spec(str(TARGET))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    record = {"name": "elsewhere/target", "model_type": spec.family, "num_hidden_layers": spec.num_layers,
              "sha256": load_target_spec(str(shutil.copytree(TARGET, tmp_path / "copy"))).fingerprint()["sha256"]}
    (drafter / "config.json").write_text(json.dumps({"dflash_target": record}))
    assert init_drafter_note(drafter, spec, spec.fingerprint()) is None
    (drafter / "config.json").write_text(json.dumps({"dflash_target": {**record, "sha256": "0" * 64}}))
    assert init_drafter_note(drafter, spec, spec.fingerprint()) == (
        f"--init-drafter {drafter}: trained on elsewhere/target, another model than --target {TARGET} (by content): "
        "its weights start this run all the same")


def test_a_run_resolves_its_target_kind_and_loss_once(tiny_run_inputs, tmp_path, monkeypatch):
    """From the checked options to the exported drafter (target loaded, drafter and objective built,
    steps, evaluation, export), the training code makes --target's spec, looks the drafter kind up and
    parses --loss once each (`resolve_run`); the parts take their piece. Before, `plan.py` and `models.py`
    looked the kind up in six places and parsed --loss in three. The options' own checks (`load_config`)
    are not counted."""
    import sys
    from collections import Counter

    import dflash.training.config as config
    from dflash.drafter import kinds
    from dflash.objective import terms
    from dflash.target import spec
    from dflash.testing import train_in_process

    from ..runs import tiny_train_args

    calls, counting = [], []

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_globals["__name__"]
            if counting and caller.startswith("dflash.training"):
                calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    originals = {"load_target_spec": spec.load_target_spec, "drafter_kind": kinds.drafter_kind,
                 "parse_recipe": terms.parse_recipe}
    for name, fn in originals.items():  # wherever a module bound it, and where a function imports it from
        for module in [m for n, m in list(sys.modules.items()) if n.startswith("dflash") and m is not None]:
            if getattr(module, name, None) is fn:
                monkeypatch.setattr(module, name, counted(name, fn))

    def checked_then_counted(argv):  # the options' own checks refuse before anything: not counted
        cfg = load_config(argv)
        counting.append(True)
        return cfg

    monkeypatch.setattr(config, "load_config", checked_then_counted)
    train_in_process(tiny_train_args(*tiny_run_inputs, tmp_path / "run", "--max-steps", 2, "--eval-every", 2,
                                     "--eval-sample-turns", 0))
    assert (tmp_path / "run" / "drafter" / "model.safetensors").is_file()  # the run went to its end
    assert Counter(calls) == {"load_target_spec": 1, "drafter_kind": 1, "parse_recipe": 1}


def test_the_target_line_is_made_of_the_values_it_names():
    """`target_summary` takes the four values it prints (no `TrainConfig` below training/)."""
    from dflash.distributed.partition import target_summary

    memory = {"full": 4 * 2**30, "resident": 2**30, "shared": 2**29, "gathered": 0}
    line = target_summary(memory, 4, features=None, partition="zero3", offload=True, decodes=True)
    assert line.startswith("target: ZeRO-3 partitioned over 4 rank(s), 1.00 GiB per rank in CPU memory "
                           "(--target-offload) of 4.00 GiB, plus the embedding and lm_head replicated for the "
                           "drafter (0.50 GiB)") and "Held-out decoding at the end is skipped" in line
    assert "skipped" not in target_summary(memory, 4, features=None, partition="zero3", offload=False, decodes=False)
    assert target_summary(memory, 1, features="runs/f", partition="none", offload=False, decodes=True) == (
        "target: its features read from --features runs/f; in memory only the embedding and lm_head the drafter "
        "borrows, 4.00 GiB")
    assert target_summary(memory, 1, features=None, partition="none", offload=False, decodes=True) == (
        "target: a full copy on every rank, 4.00 GiB")
