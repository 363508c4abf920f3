"""Drafter kinds, one module each, found here by name (`--drafter-kind`) or by the `architectures` string
of a `config.json`.

A kind is a `DrafterKind` declaring everything that makes it differ from the others: its name and
architecture, its options (config keys, released defaults, checks), the settings its `config.json`
carries, its network (an `nn.Module` with the DFlash drafter's forward, `DFlashDrafter` or a subclass:
its `propose` drafts a block at decoding, its `export_tensors` is what the export writes), its extra
loss terms and logit map, and its costs: the parameters, bytes and FLOPs its own parts add to the DFlash
drafter's, which the memory plan and the FLOP cost model ask it for (`layer_params` ... `row_flops`). Its
terms name and reduce its figures (`LogitTerm.figures`). The config, the plan, the trainer, the
evaluator, sizing, decoding and the planning scripts ask this registry; none of them names a kind.

The built-in kinds are listed in `BUILT_IN` by module, imported on first use, so that the modules the
kinds build on (the drafter, its config) can ask the registry without importing any kind; a kind of
one's own is `register`ed (its module calls it), after which it trains, exports and decodes as the
built-in ones do.
"""
from __future__ import annotations

import importlib
from typing import Any

from dflash.options import Option  # a kind's options; importable from here for kinds of one's own

# name -> the module that defines it (its `KIND`): the registry's table
BUILT_IN = {"dflash": "dflash.drafter.kinds.dflash", "dflash2": "dflash.drafter.kinds.dflash2",
            "dspark": "dflash.drafter.kinds.dspark", "lilicorr": "dflash.drafter.kinds.lilicorr"}
DEFAULT = "dflash"

_registered: dict[str, DrafterKind] = {}
_listeners: list = []  # what is told of every kind registered (the training options: its own options)


class DrafterKind:
    """The DFlash drafter's answers; a kind overrides what it changes."""

    name = DEFAULT
    title = "DFlash"  # how messages name it
    architecture = "DFlashDraftModel"  # config.json's architectures
    summary = "the DFlash drafter"  # its line in --drafter-kind's help
    options: dict[str, Option] = {}  # training options only this kind reads, by name
    config_keys: tuple[str, ...] = ()  # config.json keys it computes that a DFlash drafter would refuse
    # the layers a new drafter of this kind gets when --drafter-layer-types is not given (None: all full)
    released_layer_type: str | None = None
    released_window: int | None = None
    released_is_causal: bool | None = None
    may_softcap = False  # its logits may pass a softcap: one more chunk x vocab buffer in the loss
    # its own terms read only a chunk's top-K and gold logits: alone, they run the fused head on a GPU
    # (`dflash.objective.loss.fused_head`), which keeps the chunk's logits in the compute dtype alone
    fused_head = False
    # vLLM's `speculative_config` method that serves it (vLLM 0.32: DFlash2 and LiLiCorr through "dflash")
    vllm_method = "dflash"

    network: type  # the module a config of this kind builds (`DFlashDrafter` or a subclass)

    def option(self, options, name: str):
        """The value of the kind's own option `name` in a section (`options`), its default where it has none
        (a section made by hand, as tests do; the training options have every registered kind's)."""
        return getattr(options, name, self.options[name].default)

    def released_settings(self) -> Any:
        """`DrafterConfig.kind_settings` of a new drafter of this kind (None: none)."""
        return None

    def small_settings(self, hidden_size: int, vocab_size: int) -> Any:
        """The settings of a small drafter of this kind on a target of these sizes (hidden sizes of 32 and
        more, a vocabulary of 4 and more): what the conformance suite (tests/drafter/test_kind_conformance.py)
        builds every kind with. Default: the released settings."""
        return self.released_settings()

    def read_settings(self, d: dict) -> Any:
        """The kind's settings from a config.json (raises ValueError naming a missing key)."""
        return None

    def write_config(self, config, out: dict) -> None:
        """Add the kind's settings to the config.json `out` of `config` (in place)."""

    def read_block_size(self, written: int) -> int:
        """The block size (the anchor and the drafted slots, `DrafterConfig.block_size`) of a config.json
        whose `block_size` is `written` (a kind whose engines count the block otherwise maps it back)."""
        return written

    def query_rows(self, block_size: int) -> int:
        """The rows of a block its backbone runs (the DFlash drafter's: all `block_size`; a kind whose
        anchor is its first prediction runs one fewer)."""
        return block_size

    def check_sizes(self, settings, hidden_size: int, vocab_size: int) -> None:
        """Raise ValueError naming the setting of `settings` that a target of these sizes cannot take."""

    def check_settings(self, config) -> None:
        """Raise ValueError naming the config.json key of `config` the engines would not serve."""
        if config.kind_settings is not None:
            raise ValueError(f"a {self.title} drafter has no settings of its own, got {config.kind_settings!r}")

    def terms(self, drafter, loss_options) -> list:
        """The kind's own `LogitTerm`s for `drafter` (`loss_options`: the run's loss section)."""
        return []

    def term_costs(self, loss_options) -> tuple[list[int], bool]:
        """What its own terms cost the memory plan, from the options alone (the plan is made before the
        drafter exists): each term's (chunk x vocab) float32 buffers (`LogitTerm.vocab_buffers`), and
        whether one reads the target's final states (`needs_target_states`)."""
        return [], False

    def logit_map(self, config) -> tuple[float, float | None]:
        """(scale, softcap) of the drafter's logits: softcap tanh(scale raw / softcap)."""
        return 1.0, None

    # ---- costs: what the kind's own parts add to the DFlash drafter's, for the memory plan
    # (`dflash.sizing.memory`) and the FLOP cost model (`dflash.sizing.flops`), which price the DFlash
    # drafter alone and ask the kind for the rest. `settings`: the drafter's `kind_settings`; `d`: its
    # `DrafterSizes` (the DFlash drafter's sizes: hidden, heads, head_dim, intermediate, layers, vocab,
    # block_size); `setup`: the run's `MemorySetup` (dtype_bytes, block_size, attention). Bytes and FLOPs count what
    # the kind's code saves and multiplies; the conformance suite checks them against a measured step.

    def layer_params(self, settings, d) -> int:
        """Parameters it adds to every drafter layer."""
        return 0

    def head_params(self, settings, d) -> int:
        """Parameters it adds outside the layers (heads over the hidden states or the vocabulary)."""
        return 0

    def layer_row_bytes(self, settings, d, setup) -> int:
        """Bytes one layer's own parts save for backward, per block row."""
        return 0

    def backward_row_bytes(self, settings, d, setup) -> int:
        """Bytes per block row its parts hold for a while in a layer's backward (one layer at a time)."""
        return 0

    def loss_row_bytes(self, settings, d, setup) -> int:
        """Bytes per block row its own loss terms hold at the end of the forward (with their backward's),
        beside the lm_head chunk the objective holds."""
        return 0

    def term_bytes(self, settings, d, setup) -> int:
        """Bytes its own loss terms hold in the drafter phase whatever the micro-batch's rows (copies and
        gradient accumulators of its own weights)."""
        return 0

    def term_row_bytes(self, settings, d, setup) -> int:
        """Bytes per block row its own loss terms hold through the drafter phase, beside `loss_row_bytes`
        (which the lm_head's gradient buffers absorb)."""
        return 0

    def row_flops(self, hidden: int, layers: int, block_size: int, settings, loss_options, vocab: int = 0) -> float:
        """FLOPs per block row in training it adds to the DFlash drafter's, forward and backward
        (`loss_options`: the run's loss section, its own options read with `option`; `vocab`: the target's
        vocabulary, for parts as wide as it)."""
        return 0.0


def register(kind: DrafterKind) -> DrafterKind:
    """Make `kind` known by its name and architecture (a name or architecture taken is refused)."""
    for other in _registered.values():
        if other is not kind and (other.name == kind.name or other.architecture == kind.architecture):
            raise ValueError(f"drafter kind {kind.name!r} ({kind.architecture}) clashes with {other.name!r} "
                             f"({other.architecture})")
    if _registered.get(kind.name) is not kind:
        for listener in _listeners:  # before it is known: a listener that refuses it (ValueError) keeps it out
            listener(kind)
    _registered[kind.name] = kind
    return kind


def on_register(listener) -> None:
    """Call `listener(kind)` for every kind registered from now on, before it is known (a ValueError it raises
    refuses the kind)."""
    _listeners.append(listener)


def drafter_kind(name: str) -> DrafterKind:
    """The kind of `--drafter-kind` `name` (raises ValueError naming the kinds)."""
    if name not in _registered and name in BUILT_IN:
        register(importlib.import_module(BUILT_IN[name]).KIND)
    if name not in _registered:
        raise ValueError(f"unknown drafter kind {name!r} (known: {', '.join(kind_names())})")
    return _registered[name]


def all_kinds() -> list[DrafterKind]:
    """Every kind: the built-in ones, then those registered since."""
    for name in BUILT_IN:
        drafter_kind(name)
    return list(_registered.values())


def kind_names() -> tuple[str, ...]:
    return (*BUILT_IN, *(n for n in _registered if n not in BUILT_IN))


def architectures() -> tuple[str, ...]:
    return tuple(k.architecture for k in all_kinds())


def kind_of_architectures(architectures_field) -> DrafterKind:
    """The kind of a config.json's `architectures` (absent: DFlash); raises ValueError for another."""
    if architectures_field is None:
        return drafter_kind(DEFAULT)
    for kind in all_kinds():
        if list(architectures_field) == [kind.architecture]:
            return kind
    known = architectures()
    raise ValueError(f"architectures is {architectures_field}; this trains {' and '.join(known)} drafters only")
