"""The training configuration: `TrainConfig` in sections (`sections`), loaded from flags and YAML
(`load`), every option checked before anything loads (`validate`)."""
from dflash.training.config.load import (
    DEMO_PRESET,
    RANDOM_TARGET_PRESET,
    build_parser,
    init_drafter_config,
    load_config,
    load_run,
    resolve,
)
from dflash.training.config.sections import (
    OPTIONS,
    SECTION_OF,
    SECTIONS,
    TrainConfig,
    default,
    flag,
    layer_type,
    speculate_turns,
)
from dflash.training.config.validate import MUON_NO_CLIP, validate

__all__ = ["DEMO_PRESET", "MUON_NO_CLIP", "OPTIONS", "RANDOM_TARGET_PRESET", "SECTIONS", "SECTION_OF", "TrainConfig",
           "build_parser", "default", "flag", "init_drafter_config", "layer_type", "load_config", "load_run", "resolve",
           "speculate_turns", "validate"]
