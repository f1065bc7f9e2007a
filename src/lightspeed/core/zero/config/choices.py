"""The values a ZeRO setting may take, and the one check of each: ``"auto"``, the stages, the offload targets."""

from __future__ import annotations

from typing import Any

from lightspeed.core.errors import DeepSpeedConfigError

#: a config value the strategy fills in from the Trainer and the model at setup
AUTO = "auto"
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_TARGETS = ("none", "cpu", "nvme")


def check_zero_stage(stage: Any) -> int:
    """``stage`` when it is 0, 1, 2 or 3 (an int, not a bool); :class:`DeepSpeedConfigError` otherwise."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in ZERO_STAGES:
        raise DeepSpeedConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}.")
    return stage


def offload_target(value: str | bool | None, argument: str) -> str:
    """Normalise an offload argument: ``None``/``False`` -> ``"none"``, ``True`` -> ``"cpu"``, else one of
    :data:`OFFLOAD_TARGETS`; :class:`DeepSpeedConfigError` naming ``argument`` otherwise."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "cpu"
    if value not in OFFLOAD_TARGETS:
        raise DeepSpeedConfigError(
            f"`{argument}={value!r}` is not an offload target. Use one of {OFFLOAD_TARGETS} (or True for 'cpu')."
        )
    return value
