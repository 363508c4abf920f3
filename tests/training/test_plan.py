"""`plan_run`: what a run decides before anything loads, on its own (no process group, no weights),
and the sectioned configuration it reads."""
import pytest
import torch
import torch.distributed as dist

from dflash.errors import UserError
from dflash.sizing.memory import GIB
from dflash.target.spec import load_target_spec
from dflash.training.config import load_config
from dflash.training.plan import plan_run


def test_plan_run_sizes_the_row_budget_from_the_memory_plan_alone():
    cfg = load_config(["--target", "random:qwen3-8b", "--memory-gib", "80", "--token-budget", "4096",
                       "--num-anchors", "64", "--dtype", "bf16"])
    spec = load_target_spec(cfg.inputs.target)
    plan = plan_run(cfg, spec, device=torch.device("cpu"), world_size=8)
    assert not dist.is_initialized(), "planning talks to no rank"
    rows = plan.cfg.batches.row_budget
    usable = plan.memory.usable(80 * GIB)
    # the most rows that fit: the peak at them fits in what is usable, one block of rows more does not
    assert plan.memory.peak(4096, rows)["total"] <= usable < plan.memory.peak(4096, rows + 16 * 64)["total"]
    assert cfg.batches.row_budget == 0 and plan.cfg.replace(row_budget=0) == cfg, "only the row budget is decided"
    assert plan.drafter_settings["--target"] == spec.fingerprint() and plan.dtype == torch.bfloat16
    assert plan.ds_config["train_micro_batch_size_per_gpu"] == 1


def test_plan_run_takes_the_released_dflash2_sizes_for_the_memory_and_the_cost_model():
    from dflash.drafter.kinds.dflash2 import released_settings

    args = ["--target", "random:qwen3-8b", "--memory-gib", "80", "--token-budget", "4096", "--num-anchors", "64"]
    spec = load_target_spec("random:qwen3-8b")
    plain = plan_run(load_config(args), spec, device=torch.device("cpu"), world_size=8)
    plan = plan_run(load_config([*args, "--drafter-kind", "dflash2"]), spec, device=torch.device("cpu"), world_size=8)
    assert plain.kind_settings is None and plan.kind_settings == released_settings()
    assert plan.memory.drafter.conv_kernel == plan.kind_settings.conv_kernel_size
    assert plain.memory.drafter.conv_kernel == 0


def test_plan_run_refuses_a_run_that_cannot_fit_naming_the_memory():
    cfg = load_config(["--target", "random:qwen3-8b", "--memory-gib", "8"])
    with pytest.raises(UserError, match=r"memory plan: this run needs about .* \(--memory-gib"):
        plan_run(cfg, load_target_spec(cfg.inputs.target), device=torch.device("cpu"), world_size=1)


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
