"""The training configuration in sections, one per part of a run; the field docs are `--help`.

Every option has one name, its flag without the dashes (`--token-budget` is `token_budget`), unique
across the sections: flags and YAML keys stay flat (`lr: 3e-3`; a YAML may also group keys under
their section, `optim: {lr: 3e-3}`), and each part of a run reads the section it is built from
(`cfg.batches.token_budget`, `cfg.optim.lr`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dflash import demo
from dflash.data.planner import DEFAULT_WINDOW, LAYOUTS, ORDERS
from dflash.data.vocab import MASK_TOKEN
from dflash.drafter.config_format import FULL, LAYER_TYPES, SLIDING
from dflash.drafter.kinds import DEFAULT, all_kinds, on_register
from dflash.objective.anchors import DEFAULT_NUM_ANCHORS
from dflash.objective.terms import term_options
from dflash.ops import ATTENTION_BACKENDS

TARGET_PARTITIONS = ("none", "zero3")
OPTIMIZERS = ("adamw", "muon")
SPECULATE_TURNS_MAX = 100  # held-out turns decoded at the end of a run of at least as many steps


def layer_type(name: str) -> str:
    """A drafter layer type from its short or full name (sliding / full, or as in config.json)."""
    full = {"sliding": SLIDING, "full": FULL}.get(name, name)
    if full not in LAYER_TYPES:
        raise ValueError(name)
    return full


layer_type.expected = "sliding or full"


def _opt(default, help, list_options: dict | None = None):
    """An option: its default, its `--help` text (or the function that makes it when a parser is built)
    and, for a comma-separated list, how to check it."""
    return field(default=default, metadata={"help": help, **({"list": list_options} if list_options else {})})


# the loss terms' options (`LogitTerm.options`) and the drafter kinds' own (`DrafterKind.options`) by name:
# (term or kind, option). The kinds' are gathered from the registry as kinds register (`_gather_kind_options`),
# so that a kind registered after this module is imported has its options too
TERM_OPTIONS = term_options()
KIND_OPTIONS: dict = {}
_OWN: dict = {}  # section -> its dataclass without the options the terms and kinds add


def _with_added_options(section: str):
    """The section's dataclass with the options the loss terms and the drafter kinds add to it
    (`TERM_OPTIONS`, `KIND_OPTIONS`), after its own; built again when a kind adds one."""
    def build(cls):
        _OWN[section] = dataclass(frozen=True)(cls)
        return _added(section)

    return build


def _added(section: str):
    cls = _OWN[section]
    extra = [(name, type(o.default), _opt(o.default, o.help))
             for name, (_, o) in {**TERM_OPTIONS, **KIND_OPTIONS}.items() if o.section == section]
    if not extra:
        return cls
    built = dataclasses.make_dataclass(cls.__name__, extra, bases=(cls,), frozen=True)
    built.__doc__, built.__module__, built.__qualname__ = cls.__doc__, cls.__module__, cls.__qualname__
    return built


def _kinds_help() -> str:
    """--drafter-kind's help, from the kinds registered when the parser is built."""
    kinds = all_kinds()
    others = "; ".join(f"{k.name}: {k.summary}" for k in kinds if k.name != DEFAULT) or "the DFlash drafter"
    return f"{', '.join(k.name for k in kinds)}: {others}"


@_with_added_options("inputs")
class Inputs:
    """What to train on: the target, the data, how samples are cut and held out."""

    target: str = _opt(
        str(demo.TARGET),
        "the frozen target: a Hugging Face causal LM folder, a Hub id (ORG/NAME, from the Hugging Face cache or "
        "downloaded), or a .gguf file or a folder holding one (default: the built-in demo target); "
        "random:qwen3-8b or random:PATH (PATH holding a config.json): random weights of that shape and a synthetic "
        "tokenizer, to benchmark before downloading anything (data: random)",
    )
    data: str = _opt(
        str(demo.DATA),
        "token store folder, or conversations (a JSONL, JSON, parquet or Arrow file, a folder of parquet shards, a "
        "datasets save_to_disk folder) prepared on the fly with the target's tokenizer "
        "(default: the demo data); random or random:SAMPLES: synthetic samples with seed-like lengths and random "
        "token ids, made in memory (default with a random target; 10,000 samples)",
    )
    messages_field: str = _opt(
        "", "when --data is a parquet, Arrow, JSON or datasets folder: the column holding each conversation's turns "
        "({role, content} or ShareGPT {from, value}); default: messages, else conversations",
    )
    features: str = _opt(
        "", "a feature store (launch/capture_features.py) of --target on --data (then the token store it was "
        "captured from): training and evaluation read the target's features from it; the target's weights never load",
    )
    max_length: int = _opt(0, "when --data is not a store: truncate samples to this many tokens (0: the token budget)")
    eval_fraction: float = _opt(0.02, "share of samples held out for evaluation")
    subset_tokens: int = _opt(
        0,
        "train on a random subset of the training split holding about this many tokens, the same samples whatever "
        "the order and layout (benchmarks: compare_modes.py times every mode on one subset); 0: all",
    )


@_with_added_options("batches")
class Batches:
    """How samples become micro-batches and optimizer steps: order, layout, budgets, dealing."""

    order: str = _opt("shuffle", f"batch order: {', '.join(ORDERS)}")
    layout: str = _opt("packed", f"micro-batch layout: {', '.join(LAYOUTS)}")
    token_budget: int = _opt(16384, "tokens per micro-batch (padded: count x longest; packed: sum of lengths)")
    step_tokens: int = _opt(
        0,
        "real tokens per rank per optimizer step; micro-batches are added until a step reaches it (0: 4 x token "
        "budget)",
    )
    buckets: int = _opt(6, "number of optimal length buckets for --order bucketed")
    boundaries: tuple[int, ...] | None = _opt(
        None,
        "bucket boundaries instead of --buckets, e.g. 770,1216,1728",
        list_options={"increasing": True, "minimum": 1},
    )
    packing_window: int = _opt(DEFAULT_WINDOW, "open bins of the best-fit packer")
    row_budget: int = _opt(
        0,
        "drafter block rows per micro-batch at most (block size x anchors per sample, summed; the drafter's "
        "activations grow with them); 0: the most that fits in --memory-gib by the memory plan (no cap when no "
        "memory is known: a CPU run without --memory-gib)",
    )
    balance: bool = _opt(
        True,
        "deal micro-batches of similar cost (target tokens and attention, drafter rows) to the ranks of each "
        "micro-step, so that ranks wait less for each other (changes nothing on one rank)",
    )
    cost_model: str = _opt(
        "",
        "JSON cost model for --balance (coefficients as written by compare_modes.py's calibration, "
        "cost_model.json); empty: FLOPs from the target's and drafter's sizes",
    )
    num_workers: int = _opt(1, "data-loader worker processes collating micro-batches ahead of compute")


@_with_added_options("drafter")
class Drafter:
    """The drafter's shape and its blocks: kind, layers, block size, anchors, taps, mask token."""

    drafter_kind: str = _opt(DEFAULT, _kinds_help)
    draft_layers: int = _opt(5, "drafter decoder layers")
    block_size: int = _opt(16, "drafted tokens per block, anchor slot included")
    num_anchors: int = _opt(DEFAULT_NUM_ANCHORS, "anchors drawn per sample (fewer if it has fewer candidates)")
    target_layer_ids: tuple[int, ...] | None = _opt(
        None,
        "tapped target layers, e.g. 1,9,17,25,33 (default: the official rule)",
        list_options={"distinct": True, "minimum": 0},
    )
    num_target_features: int = _opt(5, "number of taps when --target-layer-ids is not given")
    mask_token: str = _opt(
        "",
        f"text of the token the drafter's block slots hold (empty: add {MASK_TOKEN} in a spare row of the target's "
        "embedding); an existing token the data never use, e.g. a reserved special token, when there is no spare row",
    )
    drafter_layer_types: tuple[str, ...] | None = _opt(
        None,
        "attention of each drafter layer, e.g. sliding,sliding,sliding,sliding,full: a sliding layer sees the last "
        "--sliding-window positions and is causal within the block, as vLLM and SGLang serve it (default: all full)",
        list_options={"cast": layer_type},
    )
    sliding_window: int = _opt(0, "positions a sliding drafter layer sees, its own included (config.json "
                               "sliding_window; needed with sliding layers)")
    init_drafter: str = _opt(
        "",
        "start from this drafter folder (official format, ours or a released one): its weights, block size, mask "
        "token, tapped layers and layer types, checked against the target; the optimizer starts fresh (--resume "
        "still continues a checkpoint)",
    )


@_with_added_options("loss")
class Loss:
    """The objective: its terms and weights, their settings, the noise on the features."""

    loss: str = _opt(
        "ce=1",
        "the objective, comma-separated part=weight: ce (slot-weighted cross-entropy with the data), dpace (D-PACE: "
        "cross-entropy weighted by each slot's share of the block's expected acceptance, no gamma decay), kl "
        "(KL(target || drafter) at --distill-temperature), lk (-log of the expected acceptance sum_v min(p, q) at "
        "--distill-temperature); e.g. ce=1,dpace=0.5 or ce=0.5,kl=1. kl and lk run the target to its last layer",
    )
    gamma: float = _opt(0.0, "loss decay exp(-(k-1)/gamma) (0: 7/5/4 for block 16/10/8)")
    feature_noise: float = _opt(
        0.0,
        "std of Gaussian noise added to the tapped target features in training (not evaluation), the same for a "
        "sample in an epoch whatever its micro-batch (seeded by --seed, epoch, sample); 0: none",
    )


@_with_added_options("optim")
class Optim:
    """The optimizer and its schedule over the run's epochs or steps."""

    optimizer: str = _opt(
        "adamw",
        f"{', '.join(OPTIMIZERS)}: muon is DeepSpeed's Muon (MuonWithAuxAdam, ZeRO 1-3): Muon for the drafter's "
        "matrices, AdamW at --lr for the rest (norms, biases); no gradient clipping with it (--grad-clip 0)",
    )
    lr: float = _opt(6e-4, "peak AdamW learning rate")
    muon_lr: float = _opt(0.0, "muon: peak Muon learning rate (0: 10 x --lr, speculators' ratio)")
    muon_momentum: float = _opt(0.95, "muon: Muon's momentum")
    weight_decay: float = _opt(0.0, "AdamW (and Muon) weight decay")
    warmup_ratio: float = _opt(0.04, "share of steps of linear warm-up")
    schedule: str = _opt("cosine", "learning-rate schedule after warm-up: cosine, linear, constant")
    grad_clip: float = _opt(1.0, "gradient clipping norm (fills 'gradient_clipping': 'auto'); with --optimizer "
                            "muon the default is 0")
    epochs: int = _opt(6, "passes over the training split")
    max_steps: int = _opt(0, "train this many optimizer steps in all (0: all epochs); the schedule spans them")


@_with_added_options("eval")
class Eval:
    """The held-out evaluation walk and the end-of-run speculative decoding."""

    eval_every: int = _opt(
        0,
        "evaluate on the held-out split every N steps and at the end (one less than N/2 steps before the end is "
        "left to the end's; 0: once per epoch and at the end): walk tau (what greedy speculative decoding "
        "reaches), anchor tau, per-slot accuracy, loss",
    )
    eval_temperatures: tuple[float, ...] = _opt(
        (0.0, 1.0),
        "temperatures of the eval walk, e.g. 0,0.7,1: tau@T, the expected acceptance length of speculative sampling "
        "at T (drafts drawn from the drafter at T, the engines' ratio test) along the held-out turns, beside "
        "greedy tau (tau@0 = tau; 0 alone: greedy only); exact in expectation when the turns were sampled at T",
        list_options={"cast": float, "distinct": True, "minimum": 0},
    )
    eval_sample_turns: int = _opt(
        100,
        "tau@T at a temperature T > 0 the held-out turns were not sampled at (their meta.temperature; unknown counts "
        "as not): walk the prompts of the first N held-out turns continued by the target alone at T (sampled once "
        "per run, the same at every evaluation, kept in eval_turns.json), so that tau@T is decoding's expected "
        "acceptance at T on those prompts, with its standard error tau@T_stderr; 0: walk the held-out turns as "
        "they are (tau@T then reads what decoding would accept had it produced them)",
    )
    speculate_turns: int = _opt(
        -1,
        "at the end, decode this many held-out assistant turns by speculative decoding with the exported drafter "
        f"and print the acceptance length (0: skip; -1: one per optimizer step of the run, at most "
        f"{SPECULATE_TURNS_MAX}, so that a short run stays short)",
    )


@_with_added_options("device")
class Device:
    """Where and how the models run: precision, kernels, the target's partition, memory, DeepSpeed."""

    dtype: str = _opt("auto", "auto (bf16 on GPU, fp32 on CPU), bf16, fp32")
    attention_backend: str = _opt("auto", f"dflash.ops backend: {', '.join(ATTENTION_BACKENDS)} (auto: Triton on "
                                  "CUDA; torch_varlen / flash_attn serve the target, the drafter then uses flex)")
    target_partition: str = _opt(
        "none",
        f"{', '.join(TARGET_PARTITIONS)}: zero3 partitions the frozen target's parameters across all ranks "
        "(DeepSpeed ZeRO-3, a layer gathered as it runs): for targets larger than one GPU; none keeps a full copy "
        "per rank (fastest when it fits)",
    )
    target_offload: bool = _opt(
        False,
        "with --target-partition zero3: keep the target's partitions in CPU memory (copied to the GPU layer by "
        "layer; slower, for targets larger than all GPUs together)",
    )
    memory_gib: float = _opt(
        0.0,
        "accelerator memory per rank the run must fit in, GiB (0: the GPU's total memory; a CPU run: no limit); "
        "the memory plan refuses a run that cannot fit, before anything loads, and sizes --row-budget",
    )
    activation_checkpointing: bool = _opt(
        False,
        "recompute drafter layers in backward: less activation memory, about a third more drafter compute",
    )
    deepspeed_config: str = _opt("ds_configs/zero2.json", "DeepSpeed JSON; 'auto' values are filled from these options")


@_with_added_options("run")
class Run:
    """The run folder and its control: seed, resume, checkpoints, logs, export, timing."""

    output_dir: str = _opt("runs/demo", "run folder: metrics, TensorBoard, checkpoints, exported drafter")
    seed: int = _opt(0, "seed of the planner, anchors, split and initialisation")
    resume: bool = _opt(False, "continue from the newest complete checkpoint in the output dir")
    force_resume: bool = _opt(
        False,
        "resume even if data, world size or planner settings changed (prints what changes)",
    )
    overwrite: bool = _opt(
        False,
        "start over in a run folder that holds a previous run: delete that run's files (config, metrics, "
        "checkpoints, TensorBoard, export, sample logs) and nothing else",
    )
    stop_at_step: int = _opt(
        0,
        "stop after this step with a checkpoint, as if interrupted; --resume continues the same schedule",
    )
    checkpoint_every: int = _opt(0, "save a checkpoint every N steps (0: at the end of each epoch)")
    keep_checkpoints: int = _opt(2, "how many of the newest checkpoints to keep")
    log_every: int = _opt(1, "write metrics every N steps (a host sync point)")
    sample_log: bool = _opt(False, "write which samples every step used to samples.rank<N>.jsonl (store indices)")
    max_nonfinite_steps: int = _opt(
        5,
        "stop (with a checkpoint) after this many optimizer steps in a row with non-finite loss or gradients; "
        "each is skipped",
    )
    export: bool = _opt(True, "export the drafter (save_pretrained) at the end")
    progress: bool = _opt(True, "show a progress bar on rank 0")
    time_micro_batches: bool = _opt(
        False,
        "time every micro-batch (a device sync after each) and log the times with their cost features, to "
        "calibrate the cost model",
    )
    time_phases: bool = _opt(
        False,
        "time the phases of every logged step with device events (target forward, drafter forward and backward, "
        "loss, optimizer; no sync of their own) and log them as phase_seconds",
    )


SECTIONS = {"inputs": Inputs, "batches": Batches, "drafter": Drafter, "loss": Loss, "optim": Optim, "eval": Eval,
            "device": Device, "run": Run}
# option name -> its section
SECTION_OF = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
OPTIONS = {f.name: f for cls in SECTIONS.values() for f in dataclasses.fields(cls)}  # name -> its field


def _gather_kind_options(kind) -> None:
    """Add `kind`'s own options to their sections (the registry calls this as it registers a kind, before it
    is known: a name another option has refuses the kind). The dicts above change in place, so that what
    imported them sees the new options; a section's dataclass is built again with them."""
    mine = {name: option for name, option in kind.options.items() if KIND_OPTIONS.get(name, (None,))[0] is not kind}
    for name, option in mine.items():
        if option.section not in SECTIONS:
            raise ValueError(f"drafter kind {kind.name!r}: its option {name!r} is in section {option.section!r}; the "
                             f"sections are {', '.join(SECTIONS)}")
        if name in OPTIONS:
            raise ValueError(f"drafter kind {kind.name!r}: its option {name!r} is already an option"
                             f"{f' of the {KIND_OPTIONS[name][0].name} kind' if name in KIND_OPTIONS else ''}")
    if not mine:
        return
    KIND_OPTIONS.update({name: (kind, option) for name, option in mine.items()})
    for section in {option.section for option in mine.values()}:
        cls = _added(section)
        SECTIONS[section] = globals()[cls.__name__] = cls
        for f in dataclasses.fields(cls):
            SECTION_OF[f.name], OPTIONS[f.name] = section, f


def _current(section: str, values):
    """A section's values as the section is now: one made before a kind added its options gets them at their
    defaults."""
    cls = SECTIONS[section]
    if type(values) is cls:
        return values
    return cls(**{f.name: getattr(values, f.name) for f in dataclasses.fields(values)})


@dataclass(frozen=True)
class TrainConfig:
    """A run's options, by section. Build it from option names (`TrainConfig.of(lr=3e-3)`), change it by
    option names (`cfg.replace(row_budget=...)`), read it by section (`cfg.optim.lr`)."""

    inputs: Inputs = field(default_factory=lambda: SECTIONS["inputs"]())
    batches: Batches = field(default_factory=lambda: SECTIONS["batches"]())
    drafter: Drafter = field(default_factory=lambda: SECTIONS["drafter"]())
    loss: Loss = field(default_factory=lambda: SECTIONS["loss"]())
    optim: Optim = field(default_factory=lambda: SECTIONS["optim"]())
    eval: Eval = field(default_factory=lambda: SECTIONS["eval"]())
    device: Device = field(default_factory=lambda: SECTIONS["device"]())
    run: Run = field(default_factory=lambda: SECTIONS["run"]())

    @classmethod
    def of(cls, **options) -> TrainConfig:
        """The defaults with `options` (names as flags, without dashes) set."""
        return cls().replace(**options)

    def replace(self, **options) -> TrainConfig:
        unknown = sorted(set(options) - set(SECTION_OF))
        if unknown:
            raise TypeError(f"unknown options {unknown}")
        changed = {}
        for name, value in options.items():
            changed.setdefault(SECTION_OF[name], {})[name] = value
        return dataclasses.replace(self, **{s: dataclasses.replace(_current(s, getattr(self, s)), **v)
                                            for s, v in changed.items()})

    def value(self, name: str):
        """The value of the option `name`."""
        section = SECTION_OF[name]
        return getattr(_current(section, getattr(self, section)), name)

    def options(self) -> dict:
        """Every option by name: the run's config.json, which `--config` reads back."""
        return {name: self.value(name) for name in SECTION_OF}


def flag(name: str) -> str:
    """The command-line flag of the option `name`."""
    return "--" + name.replace("_", "-")


def default(name: str):
    """The default value of the option `name`."""
    return OPTIONS[name].default


def speculate_turns(c: TrainConfig, total_steps: int) -> int:
    """Held-out turns to decode at the end: --speculate-turns, or with -1 one per optimizer step of
    the run, at most SPECULATE_TURNS_MAX (a 4-step run decodes 4 turns, not 100)."""
    turns = c.eval.speculate_turns
    return turns if turns >= 0 else min(total_steps, SPECULATE_TURNS_MAX)


# the kinds' own options: the built-in kinds' now, a kind's registered later as it registers
on_register(_gather_kind_options)
for _kind in all_kinds():
    _gather_kind_options(_kind)
