"""DeepSpeed config handling for our ZeRO strategies: loading, key validation, presets, merging, and resolving
"auto" values against the Trainer settings. Only torch, DeepSpeed and the standard library: no Lightning."""

from lightspeed.core.deepspeed_config.errors import DeepSpeedConfigError
from lightspeed.core.deepspeed_config.facts import OptimizerFacts, TrainingFacts
from lightspeed.core.deepspeed_config.loading import describe_config, load_user_config
from lightspeed.core.deepspeed_config.merging import merge_configs
from lightspeed.core.deepspeed_config.model_introspection import find_hidden_size
from lightspeed.core.deepspeed_config.presets import zero_preset
from lightspeed.core.deepspeed_config.resolution import resolve_config, resolve_config_with_notes
from lightspeed.core.deepspeed_config.validation import validate_keys

__all__ = [
    "DeepSpeedConfigError",
    "OptimizerFacts",
    "TrainingFacts",
    "describe_config",
    "find_hidden_size",
    "load_user_config",
    "merge_configs",
    "resolve_config",
    "resolve_config_with_notes",
    "validate_keys",
    "zero_preset",
]
