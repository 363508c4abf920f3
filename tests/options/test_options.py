"""Every numeric option of every `launch/` command is range-checked in one place (dflash.options.number
for the commands' own options, `training.config.validate` for the trainer's), with the flag named:
each is walked here with NaN, infinities and the first value outside its range."""
from __future__ import annotations

import argparse
import inspect
import os
import sys

import pytest

from dflash.errors import UserError
from dflash.training.config import OPTIONS, flag, load_config
from dflash.training.config.load import _kind

from ..conftest import ROOT, launch_script

COMMANDS = sorted(p.stem for p in (ROOT / "launch").glob("*.py"))
TRAIN_FLAGS = {flag(name) for name in OPTIONS} | {"--deepspeed_config"}


class Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def own_parser(name, monkeypatch):
    """The parser `launch/NAME.py` reads its own options with (the first it parses with)."""
    def capture(self, *args, **kwargs):
        raise Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    monkeypatch.setattr(sys, "argv", [f"{name}.py"])
    # Some commands set or drop variables as they load (compile_kernels drops TRITON_INTERPRET):
    # the rest of the session must not run without the interpreter.
    env = dict(os.environ)
    try:
        main = launch_script(name).main
        with pytest.raises(Captured) as got:
            main([]) if inspect.signature(main).parameters else main()
    finally:
        os.environ.clear()
        os.environ.update(env)
    return got.value.parser


def outside(bounds):
    """The values a numeric option must refuse: not finite, and the first one past each bound."""
    kind, minimum, above, maximum = bounds
    step = 1 if kind is int else 1e-6
    bad = ["nan", "inf", "-inf"]
    bad += [str(minimum - step)] if minimum is not None else []
    bad += [str(above)] if above is not None else []
    bad += [str(maximum + step)] if maximum is not None else []
    return bad


def numeric(action):
    return action.type in (int, float) or hasattr(action.type, "bounds")


@pytest.mark.parametrize("name", COMMANDS)
def test_every_numeric_option_of_a_command_refuses_what_it_cannot_mean_naming_the_flag(name, monkeypatch, capsys):
    parser = own_parser(name, monkeypatch)
    monkeypatch.undo()
    options = [a for a in parser._actions if numeric(a) and a.option_strings[0] not in TRAIN_FLAGS]
    for action in options:
        flag = action.option_strings[0]
        assert hasattr(action.type, "bounds"), f"{name}.py {flag}: declare its range with dflash.options.number"
        for value in outside(action.type.bounds):
            with pytest.raises(SystemExit) as e:
                parser.parse_known_args([f"{flag}={value}"])
            assert e.value.code == 2
            err = capsys.readouterr().err
            assert f"error: argument {flag}" in err, (name, flag, value, err)


# the first negative value an option refuses, where -1 means something
FIRST_NEGATIVE = {"--speculate-turns": "-2"}
NUMERIC_TRAIN_FIELDS = [f for f in OPTIONS.values() if _kind(f) in ("int", "float")]


@pytest.mark.parametrize("field", NUMERIC_TRAIN_FIELDS, ids=lambda f: flag(f.name))
def test_every_numeric_training_option_refuses_nan_infinities_and_negatives_naming_the_flag(field, capsys):
    """train.py, measure_memory.py and compare_modes.py share these options (`load_config`)."""
    option = flag(field.name)
    for value in ("nan", "inf", "-inf", FIRST_NEGATIVE.get(option, "-1")):
        try:
            load_config(["--data", "d.jsonl", f"{option}={value}"])
        except UserError as err:
            assert str(err).startswith(option), (option, value, str(err))
        except SystemExit as e:  # argparse: not an integer
            assert e.code == 2 and f"argument {option}" in capsys.readouterr().err
        else:
            pytest.fail(f"{option} {value} accepted")


def valid_value(action):
    """A value `action` accepts (none for a flag without one)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    return ["1" if numeric(action) else "x"]


@pytest.mark.parametrize("name", COMMANDS)
def test_an_option_given_under_two_of_its_names_is_refused_naming_both(name, monkeypatch, capsys):
    """`plan_memory.py --memory-gib 40 --gpu-memory-gib 80` (an option and its older name) used to plan
    with the last one; every option of several names, in every command, is refused naming both."""
    parser = own_parser(name, monkeypatch)
    monkeypatch.undo()
    for action in parser._actions:
        names = [n for n in action.option_strings if not n.startswith("--no-")]
        if isinstance(action, argparse._HelpAction) or len(names) < 2:
            continue
        first, second = names[0], names[-1]
        with pytest.raises(SystemExit):
            parser.parse_args([first, *valid_value(action), second, *valid_value(action)])
        assert f"error: {first} and {second} are one option (two names of it): give it once" in capsys.readouterr().err
        # either name alone, or one name twice, is taken (the later value: argparse's rule for one name)
        assert parser.parse_args([second, *valid_value(action), second, *valid_value(action)]) is not None
