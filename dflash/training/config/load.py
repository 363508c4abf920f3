"""Options into a `TrainConfig`: `--help` from the field docs (grouped by section), YAML + flags.

Precedence: the defaults (the paper's recipe) < the built-in demo preset (only when neither
--target nor --data is given) < the YAML file of --config < command-line flags. `load_config`
resolves every option once: lists become tuples (of ints, or floats where said), derived defaults
(step tokens, maximum length, gamma) are filled in, and every value is checked (`validate`), so a
bad one fails before anything loads. The rest of the code reads the result and interprets nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from dflash import demo
from dflash.drafter.kinds import drafter_kind
from dflash.errors import UserError
from dflash.objective.loss import GAMMA_BY_BLOCK_SIZE
from dflash.options import given_as, number, one_name, parse_list
from dflash.training.config.sections import OPTIONS, SECTION_OF, SECTIONS, TrainConfig, flag, layer_type
from dflash.training.config.validate import validate

# The built-in demo: the tiny target and the data it regenerated (the dataclass defaults), sized
# to run on a laptop CPU in a few minutes.
DEMO_PRESET = {
    "target": str(demo.TARGET),
    "data": str(demo.DATA),
    "output_dir": "runs/demo",
    # many small steps: on this data the drafter learns faster per token (2,048-token steps reach a
    # held-out decoding acceptance length above 2 in 3 epochs; 4,096-token steps stop at 1.6)
    "token_budget": 2048,
    "step_tokens": 2048,
    "epochs": 3,
    "lr": 3e-3,
    "num_anchors": 64,
    "draft_layers": 2,
    "num_target_features": 3,
    "eval_fraction": 0.05,
    "eval_every": 21,
    "max_length": 1024,
    # speculators' recipe at a constant rate after the warm-up: the best of launch/compare_recipes.py
    # on this demo at equal training seconds over 4 seeds (docs/BENCHMARKS.md, "Recipes by decoding
    # acceptance"); 3 epochs are too few for a cosine's tail to pay
    "loss": "ce=1,dpace=0.5",
    "feature_noise": 0.05,
    "optimizer": "muon",
    "schedule": "constant",
}


# A random target (--target random:...): synthetic data, no held-out decoding (its acceptance means nothing).
# random weights: no end of turn to decode to, and samples of noise to walk
RANDOM_TARGET_PRESET = {"data": "random", "output_dir": "runs/random", "speculate_turns": 0, "eval_sample_turns": 0}


def _kind(f: dataclasses.Field) -> str:
    if "list" in f.metadata:
        return "list"
    return f.type if isinstance(f.type, str) else f.type.__name__


def _list_parser(f: dataclasses.Field, where: str):
    return lambda text: parse_list(text, where, **f.metadata["list"])


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file of options (keys as below, with underscores)")
    p.add_argument("--local_rank", "--local-rank", type=number(int, minimum=-1), default=-1,  # set by the launcher
                   action=one_name(),
                   help=argparse.SUPPRESS)
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(section, cls.__doc__)
        for f in dataclasses.fields(cls):
            _add_option(group, f.name, None)
    return p


def _add_option(parser, name: str, default, aliases=(), help_default=None, help_text=None) -> None:
    f = OPTIONS[name]
    shown = f.default if help_default is None else help_default
    text = help_text or f.metadata["help"]
    text = text() if callable(text) else text  # made now: what is registered when the parser is built
    kwargs = {"dest": f.name, "default": default, "help": f"{text} (default: {shown!r})"}
    kind = _kind(f)
    if kind == "bool":
        kwargs["action"] = argparse.BooleanOptionalAction
    elif kind == "list":
        kwargs["type"] = _list_parser(f, flag(f.name))
    else:
        kwargs["type"] = {"int": int, "float": float, "str": str}[kind]
    names = [flag(f.name)] + (["--deepspeed_config"] if f.name == "deepspeed_config" else []) + list(aliases)
    if len(names) > 1:  # an option of several names is given under one of them
        kwargs["action"] = one_name(kwargs.get("action"))
    parser.add_argument(*names, **kwargs)


# What the planning scripts (launch/plan_memory.py, plan_batches.py) plan for when not told: a Qwen3-8B
# target on 80 GiB GPUs, not the demo's (their `add_options` defaults)
PLANNING_DEFAULTS = {"target": "qwen3-8b", "memory_gib": 80.0}


def add_options(parser, names, defaults: dict | None = None, aliases: dict | None = None,
                helps: dict | None = None) -> None:
    """train.py's options `names` on another script's parser (a planning script's): the same flags, types,
    help and defaults, or the script's own `defaults` (`PLANNING_DEFAULTS`) and `helps` (what the option
    means there), and older flag names as deprecated `aliases`. `options_of(args, names)` reads them back
    into a `TrainConfig`, checked as train.py checks them."""
    defaults, aliases, helps = defaults or {}, aliases or {}, helps or {}
    for name in names:
        value = defaults.get(name, OPTIONS[name].default)
        _add_option(parser, name, value, aliases.get(name, ()), value, helps.get(name))


def options_of(args, names) -> TrainConfig:
    """The options `names` of parsed `args` (`add_options`) as a `TrainConfig`, each checked on its own
    and a drafter kind's options against the kind, as train.py checks them (UserError naming the flag)."""
    from dflash.training.config.validate import check_each, check_kind_options

    c = TrainConfig.of(**{name: getattr(args, name) for name in names})
    try:
        check_each(c, names)
        check_kind_options(c)
    except UserError as err:  # named as the user typed it (an older name of the option included)
        typed = {flag(name): given_as(args, name, flag(name)) for name in names}
        wrong = str(err).split(":", 1)[0]
        if typed.get(wrong, wrong) != wrong:
            raise UserError(typed[wrong] + str(err)[len(wrong):]) from None
        raise
    return c


def load_config(argv=None, description: str = "") -> TrainConfig:
    """Parse flags (and --config YAML) into a resolved, validated TrainConfig."""
    from dflash.target.spec import target_folder

    args = build_parser(description).parse_args(argv)
    values = {}
    if args.config:
        values.update(_read_yaml(args.config))
    cli = {name: getattr(args, name) for name in OPTIONS if getattr(args, name) is not None}
    values.update(cli)
    explicit = set(values)  # the user's own options (YAML and flags), not the demo preset's
    if "target" not in values and "data" not in values:
        values = {**DEMO_PRESET, **values}
    elif "target" in values and target_folder(values["target"]) is None:  # random:...
        values = {**RANDOM_TARGET_PRESET, **values}
    if values.get("optimizer") == "muon" and "grad_clip" not in explicit:
        values["grad_clip"] = 0.0  # see MUON_NO_CLIP
    if values.get("features"):  # nothing of the target runs: no turns sampled or decoded unless asked (refused)
        values = {**values, **{k: 0 for k in ("eval_sample_turns", "speculate_turns") if k not in explicit}}
    if values.get("init_drafter"):
        values = _from_init_drafter(values, explicit)
    return resolve(TrainConfig.of(**values))


def load_run(run_dir) -> TrainConfig:
    """The options a run trained with, from its folder's config.json (`RunPaths.config`), as a
    `TrainConfig`; options of an older dflash it lacks take their defaults, and names this one does
    not know (a drafter kind's not registered here) are left out. Raises UserError naming the file."""
    import json

    from dflash.distributed.run_folder import RunPaths

    path = RunPaths(Path(run_dir)).config
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read the run's options ({e})") from None
    if not isinstance(saved, dict):
        raise UserError(f"{path}: expected a mapping of option: value")
    return TrainConfig.of(**{name: tuple(v) if isinstance(v, list) else v for name, v in saved.items()
                             if name in OPTIONS})


def init_drafter_config(folder: str, spec):
    """The DrafterConfig of --init-drafter `folder`, checked against the target (its `TargetSpec`;
    raises UserError naming the field that disagrees). Reads config files and the weights' header only."""
    from dflash.drafter.config import DrafterConfig, check_fits_target
    from dflash.folders import check_drafter_folder

    path = Path(folder)

    def fits_target(drafter, raw):
        try:
            check_fits_target(drafter, spec.config, num_target_layers_given=DrafterConfig.gives_num_target_layers(raw))
        except ValueError as e:
            raise UserError(f"--init-drafter {path / 'config.json'} does not fit --target {spec.name}: {e}") from None

    # its files there, its config fitting the target, then its weights whole and the config's
    return check_drafter_folder(path, "--init-drafter", fits_target)


def _from_init_drafter(values: dict, explicit: set) -> dict:
    """values with the drafter options taken from --init-drafter; an explicit option that
    contradicts the drafter is an error naming both."""
    if values.get("mask_token"):
        raise UserError(f"--mask-token {values['mask_token']!r} contradicts --init-drafter {values['init_drafter']}: "
                        "the drafter's dflash_config.mask_token_id is its mask token (leave --mask-token out)")
    from dflash.target.spec import load_target_spec

    c = init_drafter_config(values["init_drafter"], load_target_spec(values.get("target", OPTIONS["target"].default)))
    taken = {
        "block_size": c.block_size, "draft_layers": c.num_hidden_layers,
        "target_layer_ids": tuple(c.target_layer_ids), "num_target_features": c.num_target_features,
        "drafter_layer_types": tuple(c.layer_types), "sliding_window": c.sliding_window or 0,
        "drafter_kind": c.kind,
    }
    for name, value in taken.items():
        given = values.get(name)
        if name in explicit and given is not None and given != value and not (
                name == "drafter_layer_types" and tuple(map(layer_type, given)) == value):
            raise UserError(f"{flag(name)} {given!r} contradicts --init-drafter {values['init_drafter']}, whose "
                            f"value is {value!r} (leave {flag(name)} out)")
    return {**values, **taken}


def resolve(c: TrainConfig) -> TrainConfig:
    """Check every option and fill in the defaults that depend on others (0 = derived)."""
    validate(c)
    d, b = c.drafter, c.batches
    kind = drafter_kind(d.drafter_kind)
    if kind.released_layer_type is not None and d.drafter_layer_types is None:  # the kind's released layers
        c = c.replace(drafter_layer_types=(kind.released_layer_type,) * d.draft_layers,
                      sliding_window=d.sliding_window or kind.released_window or 0)
    return c.replace(
        step_tokens=b.step_tokens or 4 * b.token_budget,
        max_length=c.inputs.max_length or b.token_budget,
        gamma=c.loss.gamma or GAMMA_BY_BLOCK_SIZE[d.block_size],
        muon_lr=(c.optim.muon_lr or 10 * c.optim.lr) if c.optim.optimizer == "muon" else 0.0,
    )


def _read_yaml(path: str) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of option: value")
    out = {}
    for key, value in _flat_keys(data, path):
        name = str(key).replace("-", "_")
        if name not in OPTIONS:
            raise UserError(f"--config {path}: unknown key {key!r} (see `train.py --help` for the options)")
        out[name] = _typed(value, OPTIONS[name], f"--config {path}: {key!r}")
    return out


def _flat_keys(data: dict, path: str):
    """(key, value) of a YAML mapping whose keys are options, or sections (`optim:`) of them."""
    for key, value in data.items():
        section = str(key)
        if section not in SECTIONS:
            yield key, value
            continue
        if not isinstance(value, dict):
            raise UserError(f"--config {path}: {key!r} is a section: a mapping of its options, got {value!r}")
        for name, inner in value.items():
            option = str(name).replace("-", "_")
            if SECTION_OF.get(option, section) != section:
                raise UserError(f"--config {path}: {key}.{name} is an option of section {SECTION_OF[option]!r}")
            yield name, inner


def _typed(value, f: dataclasses.Field, where: str):
    """A YAML value as the option's type. YAML reads `1e-3` as a string and `[1, 9]` as a list."""
    kind = _kind(f)
    if kind == "list":
        return _list_parser(f, where)(value)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise UserError(f"{where} must be true or false, got {value!r}")
    if kind == "str":
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"{where} must be a string, got {value!r}")
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
        if kind == "int":
            if number != int(number):
                raise ValueError
            return int(number)
        return number
    except (TypeError, ValueError, OverflowError):
        raise UserError(f"{where} must be {'an integer' if kind == 'int' else 'a number'}, got {value!r}") from None


