"""Defaults resolve through the installed package, not the checkout: run from any other folder."""
import json
import subprocess
import sys

import pytest

from dflash.errors import UserError
from dflash.training.config import TrainConfig
from dflash.training.ds_config import load_ds_config, resolve_ds_config, shipped_ds_configs
from dflash.training.trainer import input_paths

from ..conftest import ROOT

NAMES = ["zero1", "zero2", "zero3", "zero3_offload"]


def test_the_checkout_ds_configs_folder_is_the_package_one():
    """One source of truth: `ds_configs/` at the repository root links to the package's JSONs."""
    assert (ROOT / "ds_configs").resolve() == shipped_ds_configs().resolve()
    assert sorted(p.stem for p in shipped_ds_configs().glob("*.json")) == NAMES


@pytest.mark.parametrize("given", ["ds_configs/zero3.json", "zero3.json", "zero3"])
def test_shipped_configs_load_by_name_from_another_folder(given, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_ds_config(given, world_size=2, grad_clip=1.0, bf16=False)
    assert config["zero_optimization"]["stage"] == 3 and config["train_batch_size"] == 2


def test_the_default_resolves_from_another_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig.of(target="random:qwen3-8b", data="random")
    assert input_paths(cfg) == {"--deepspeed_config": shipped_ds_configs() / "zero2.json"}


def test_a_users_relative_path_is_read_from_their_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds_configs").mkdir()
    mine = json.loads((shipped_ds_configs() / "zero2.json").read_text())
    mine["zero_optimization"]["stage"] = 1
    (tmp_path / "ds_configs" / "zero2.json").write_text(json.dumps(mine))
    assert resolve_ds_config("ds_configs/zero2.json").resolve() == tmp_path / "ds_configs" / "zero2.json"
    assert load_ds_config("ds_configs/zero2.json", world_size=1, grad_clip=1.0,
                          bf16=False)["zero_optimization"]["stage"] == 1
    with pytest.raises(UserError, match=r"--deepspeed_config other/zero2.json: no such file \(shipped, usable by "
                                        r"name from anywhere: zero1.json, zero2.json"):
        load_ds_config("other/zero2.json", world_size=1, grad_clip=1.0, bf16=False)


def test_the_trainer_runs_as_a_module_from_another_folder(tmp_path):
    """What the tuner launches (`deepspeed --module dflash.training.cli`), outside the checkout."""
    proc = subprocess.run([sys.executable, "-m", "dflash.training.cli", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--deepspeed_config" in proc.stdout and "Train a DFlash drafter" in proc.stdout
