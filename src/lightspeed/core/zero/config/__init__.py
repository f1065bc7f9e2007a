"""DeepSpeed config handling for the ZeRO strategies: the recipe (presets, checks, merging, key validation) and
resolving ``"auto"`` values against the Trainer's settings. Only torch, DeepSpeed and the standard library: no
Lightning. Internal: the strategies and the CLI are its users."""

from lightspeed.core.zero.config.choices import AUTO, OFFLOAD_TARGETS, ZERO_STAGES
from lightspeed.core.zero.config.facts import OptimizerFacts, TrainingFacts
from lightspeed.core.zero.config.loading import (
    CONFIG_PATH_ENV,
    config_or_environment,
    describe_config,
    load_user_config,
    summarize_config,
)
from lightspeed.core.zero.config.merging import merge_configs
from lightspeed.core.zero.config.model_introspection import find_hidden_size
from lightspeed.core.zero.config.nvme import NVME_PATH_ENV, resolve_nvme_path
from lightspeed.core.zero.config.presets import zero_preset
from lightspeed.core.zero.config.resolution import resolve_config, resolve_config_with_notes
from lightspeed.core.zero.config.validation import validate_keys
from lightspeed.core.zero.config.zero_recipe import (
    ZERO_PRESETS,
    ZeroPreset,
    ZeroTuning,
    build_zero_config,
    check_zero_section,
    config_offloads_optimizer,
    config_stage,
    config_uses_nvme,
    zero_registrations,
)

__all__ = [
    "CONFIG_PATH_ENV",
    "config_or_environment",
    "AUTO",
    "NVME_PATH_ENV",
    "OFFLOAD_TARGETS",
    "ZERO_PRESETS",
    "ZERO_STAGES",
    "OptimizerFacts",
    "TrainingFacts",
    "ZeroPreset",
    "ZeroTuning",
    "build_zero_config",
    "check_zero_section",
    "config_offloads_optimizer",
    "config_stage",
    "config_uses_nvme",
    "describe_config",
    "find_hidden_size",
    "load_user_config",
    "merge_configs",
    "resolve_config",
    "resolve_config_with_notes",
    "resolve_nvme_path",
    "summarize_config",
    "validate_keys",
    "zero_preset",
    "zero_registrations",
]
