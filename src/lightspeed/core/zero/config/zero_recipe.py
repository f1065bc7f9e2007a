"""The one recipe for a ZeRO strategy's DeepSpeed config: named presets, argument checks, the NVMe directory, the
user's config merged over the preset, and key validation.

Every entry point builds its config here: :class:`~lightspeed.strategies.ZeroStrategy` and ``zero_auto`` at
construction or setup, ``lightspeed config NAME`` and ``lightspeed test``. The result still holds ``"auto"`` values;
:func:`~lightspeed.core.zero.config.resolve_config` fills them from the Trainer and the model.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config import activation
from lightspeed.core.zero.config.choices import AUTO, check_zero_stage, offload_target
from lightspeed.core.zero.config.errors import problems_error
from lightspeed.core.zero.config.loading import config_or_environment, load_user_config
from lightspeed.core.zero.config.low_memory import check_low_memory_states
from lightspeed.core.zero.config.merging import merge_configs
from lightspeed.core.zero.config.nvme import resolve_nvme_path
from lightspeed.core.zero.config.presets import zero_preset
from lightspeed.core.zero.config.validation import validate_keys


@dataclass(frozen=True)
class ZeroPreset:
    """What a registered strategy name such as ``zero3_offload`` stands for."""

    stage: int
    offload_optimizer: str = "none"
    offload_parameters: str = "none"
    description: str = ""

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_parameters)

    def init_params(self) -> dict[str, Any]:
        """The strategy's constructor arguments for this preset (offloads only when there are any)."""
        params: dict[str, Any] = {"stage": self.stage}
        if self.offload_optimizer != "none":
            params["offload_optimizer"] = self.offload_optimizer
        if self.offload_parameters != "none":
            params["offload_parameters"] = self.offload_parameters
        return params


#: registered strategy name -> preset
ZERO_PRESETS: dict[str, ZeroPreset] = {
    "zero1": ZeroPreset(1, description="ZeRO-1: optimizer states partitioned across ranks"),
    "zero1_offload": ZeroPreset(
        1, "cpu", description="ZeRO-1 with optimizer states and step on the CPU (DeepSpeed CPU Adam)"
    ),
    "zero2": ZeroPreset(2, description="ZeRO-2: optimizer states and gradients partitioned"),
    "zero2_offload": ZeroPreset(
        2, "cpu", description="ZeRO-2 with optimizer states and step on the CPU (ZeRO-Offload)"
    ),
    "zero3": ZeroPreset(3, description="ZeRO-3: optimizer states, gradients and parameters partitioned"),
    "zero3_offload_optimizer": ZeroPreset(
        3, "cpu", description="ZeRO-3 with optimizer states and step on the CPU, parameters on the device"
    ),
    "zero3_offload": ZeroPreset(
        3, "cpu", "cpu", description="ZeRO-3 with optimizer states and parameters offloaded to the CPU"
    ),
    "zero3_nvme": ZeroPreset(
        3,
        "nvme",
        "nvme",
        description="ZeRO-Infinity: optimizer states and parameters offloaded to NVMe (nvme_path or "
        "$LIGHTSPEED_NVME_PATH)",
    ),
}

#: what ``zero_auto`` stands for, in every front end's registry
ZERO_AUTO_DESCRIPTION = "ZeRO with the fastest stage/offload that fits the model in this machine's memory"


def zero_registrations(zero: type, zero_auto: type) -> list[tuple[str, type, str, dict[str, Any]]]:
    """Every ZeRO strategy name a front end registers, as ``(name, class, description, constructor arguments)``:
    the presets with the front end's ``zero`` strategy class, and ``zero_auto`` with its ``zero_auto`` class."""
    entries = [(name, zero, preset.description, preset.init_params()) for name, preset in ZERO_PRESETS.items()]
    return [*entries, ("zero_auto", zero_auto, ZERO_AUTO_DESCRIPTION, {})]


#: the ZeroTuning knobs that go into zero_preset
_PRESET_KNOBS = (
    "pin_memory",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "sub_group_size",
)


@dataclass(frozen=True)
class ZeroTuning:
    """The knobs beyond stage and offload targets, named as the strategies' arguments: ZeRO's bucket sizes (in
    elements, ``"auto"`` derives them from the model) and activation checkpointing (DeepSpeed's
    ``activation_checkpointing`` section, ``"auto"`` resolved by :mod:`~lightspeed.core.zero.config.activation`'s
    rules, and ``activation_checkpointing_policy``, the module classes whose forward is checkpointed).

    The activation checkpointing arguments are checked here, so a bad one fails when the strategy is created; the
    policy is kept as a frozenset of classes (None: none).
    """

    pin_memory: bool = True
    reduce_bucket_size: int | str = AUTO
    allgather_bucket_size: int | str = AUTO
    prefetch_bucket_size: int | str = AUTO
    param_persistence_threshold: int | str = AUTO
    sub_group_size: int | None = None
    partition_activations: bool | str = AUTO
    cpu_checkpointing: bool | str = AUTO
    contiguous_memory_optimization: bool | str = AUTO
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    activation_checkpointing_policy: Collection[type[torch.nn.Module]] | type[torch.nn.Module] | None = None
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False

    def __post_init__(self) -> None:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise DeepSpeedConfigError(
                "bf16_optimizer_states=True keeps the optimizer moments in bf16 beside bf16 master weights; DeepSpeed "
                "needs bf16_master_weights_and_grads=True with it. Pass both, or neither."
            )
        object.__setattr__(
            self, "activation_checkpointing_policy", activation.checked_policy(self.activation_checkpointing_policy)
        )
        problems = activation.argument_problems(self._activation_arguments())
        if problems:
            raise problems_error(problems, "in the activation checkpointing arguments")

    @property
    def policy(self) -> activation.Policy | None:
        """The checked ``activation_checkpointing_policy``."""
        return activation.checked_policy(self.activation_checkpointing_policy)

    def _activation_arguments(self) -> dict[str, Any]:
        names = (*activation.AUTO_KEYS, *activation.FLAG_KEYS, activation.NUMBER_KEY)
        return {name: getattr(self, name) for name in names}

    def low_memory_states(self) -> dict[str, bool]:
        """The ``bf16`` section's low-memory keys asked for (DeepSpeed's bf16 master weights, gradients and
        optimizer moments instead of fp32 ones; they need a bf16 precision, checked when the config is resolved)."""
        keys = ("bf16_master_weights_and_grads", "bf16_optimizer_states")
        return {key: True for key in keys if getattr(self, key)}

    def activation_checkpointing_section(self) -> dict[str, Any] | None:
        """The preset's ``activation_checkpointing`` section, or None when neither the policy nor an argument asks
        for one."""
        return activation.build_section(self._activation_arguments(), self.activation_checkpointing_policy is not None)

    def for_stage(self, stage: int) -> ZeroTuning:
        """A copy without the knobs ``stage`` does not have (for a stage chosen later, as ``zero_auto`` does)."""
        if stage == 3:
            return dataclasses.replace(self, allgather_bucket_size=AUTO)  # stage 3 gathers in prefetch chunks
        return dataclasses.replace(
            self, prefetch_bucket_size=AUTO, param_persistence_threshold=AUTO, sub_group_size=None
        )


def build_zero_config(
    stage: Any,
    offload_optimizer: str | bool | None = "none",
    offload_parameters: str | bool | None = "none",
    *,
    nvme_path: str | os.PathLike | None = None,
    user_config: dict | str | os.PathLike | None = None,
    tuning: ZeroTuning = ZeroTuning(),
    front_end: str = "Trainer",
) -> dict[str, Any]:
    """The DeepSpeed config of ZeRO ``stage`` with the given offload targets, before ``"auto"`` resolution.

    Checks the stage and the offload targets (``True`` means ``"cpu"``), resolves the NVMe directory from
    ``nvme_path`` or ``$LIGHTSPEED_NVME_PATH`` when something is offloaded to NVMe (ignored otherwise), builds the
    preset (with an ``activation_checkpointing`` section when ``tuning`` asks for one), merges ``user_config`` (a dict
    or a JSON path, by default the file ``$PL_DEEPSPEED_CONFIG_PATH`` names; its values win) over it and rejects
    unknown keys and bad values. Every problem raises :class:`DeepSpeedConfigError`
    saying what to change, naming ``front_end``'s arguments (``"Trainer"`` or ``"Fabric"``).
    """
    check_zero_stage(stage)
    optimizer_target = offload_target(offload_optimizer, "offload_optimizer")
    parameter_target = offload_target(offload_parameters, "offload_parameters")
    uses_nvme = "nvme" in (optimizer_target, parameter_target)
    user = load_user_config(config_or_environment(user_config))
    preset = zero_preset(
        stage,
        offload_optimizer=optimizer_target,
        offload_parameters=parameter_target,
        nvme_path=resolve_nvme_path(nvme_path) if uses_nvme else None,
        **{name: getattr(tuning, name) for name in _PRESET_KNOBS},
    )
    checkpointing = tuning.activation_checkpointing_section()
    if checkpointing is not None:
        preset[activation.SECTION] = checkpointing
    preset["bf16"].update(tuning.low_memory_states())
    check_zero_section(user)
    merged = merge_configs(preset, user)
    validate_keys(merged, front_end)
    check_low_memory_states(merged)
    return merged


def check_zero_section(user_config: dict[str, Any]) -> None:
    """Refuse the boolean form of ``zero_optimization``: the strategy, not the config, chooses the stage."""
    if not isinstance(user_config.get("zero_optimization", {}), dict):
        raise DeepSpeedConfigError(
            '`zero_optimization` must be an object such as {"stage": 2}; lightspeed\'s ZeRO strategies choose '
            "the stage by name or `stage=`, so the boolean form is not accepted."
        )


def config_stage(config: dict[str, Any]) -> int:
    """The ZeRO stage a built config trains with (0 when it has no ``zero_optimization`` section)."""
    return int((config.get("zero_optimization") or {}).get("stage", 0))


def config_uses_nvme(config: dict[str, Any]) -> bool:
    """Whether a built config offloads anything to NVMe."""
    zero = config.get("zero_optimization") or {}
    return any((zero.get(key) or {}).get("device") == "nvme" for key in ("offload_optimizer", "offload_param"))


def config_offloads_optimizer(config: dict[str, Any]) -> bool:
    """Whether a built config runs the optimizer step on the CPU (states on the CPU or NVMe)."""
    zero = config.get("zero_optimization") or {}
    return (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")
