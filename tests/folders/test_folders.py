"""Every folder a command reads is checked before heavy work, by one function per kind, naming the
file: a drafter folder lost, cut or not what its config describes is one line, for --init-drafter
(train.py) and for --drafter (speculate.py)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash.errors import UserError
from dflash.training.config import load_config

from ..conftest import launch_script
from ..runs import released_drafter


def lose(folder):
    (folder / "model.safetensors").unlink()


def cut(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def garble(folder):
    (folder / "model.safetensors").write_bytes(b"not safetensors at all")


def other_shapes(folder):
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    name = next(k for k in tensors if k.endswith("fc.weight"))
    tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1, dtype=tensors[name].dtype)
    save_file(tensors, folder / "model.safetensors")


def fewer_layers(folder):
    config = json.loads((folder / "config.json").read_text())
    config.update(num_hidden_layers=2, layer_types=config["layer_types"][1:])
    (folder / "config.json").write_text(json.dumps(config))


CASES = {
    "no weights": (lose, "{flag} {folder}: no model.safetensors (a drafter folder in the official format holds "
                         "config.json and model.safetensors)"),
    "cut weights": (cut, "{flag}: {folder}/model.safetensors is cut short ("),
    "not safetensors": (garble, "{flag}: {folder}/model.safetensors is not a safetensors file"),
    "other shapes": (other_shapes, "{flag} {folder}/model.safetensors: does not fit its config.json: fc.weight is "),
    "config of fewer layers": (fewer_layers, "{flag} {folder}/model.safetensors: does not hold the drafter its "
                                             "config.json describes (missing [], unknown ['layers.2."),
}


@pytest.mark.parametrize("case", CASES)
def test_a_drafter_folder_lost_cut_or_not_its_config_is_one_line(tmp_path, capsys, case):
    damage, message = CASES[case]
    folder = released_drafter(tmp_path / "drafter")
    damage(folder)
    with pytest.raises(UserError) as err:
        load_config(["--init-drafter", str(folder)])
    assert str(err.value).startswith(message.format(flag="--init-drafter", folder=folder))

    cli = launch_script("speculate")
    with pytest.raises(SystemExit) as e:
        cli.main(["--drafter", str(folder)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message.format(flag="--drafter", folder=folder)) and err.count("\n") == 1, err


def test_a_target_with_a_cut_weight_file_is_one_line_before_its_weights_load(tiny_run_inputs, tmp_path):
    import shutil

    from dflash.target.spec import load_target_spec
    from dflash.training.target import load_target

    target = shutil.copytree(tiny_run_inputs[0], tmp_path / "target")
    cut(target)
    with pytest.raises(UserError, match=rf"^--target: {target}/model.safetensors is cut short \("):
        load_target(load_target_spec(str(target)), "cpu", torch.float32)
