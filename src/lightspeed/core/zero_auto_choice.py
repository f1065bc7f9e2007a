"""``zero_auto``'s decisions without a Lightning loop: its arguments checked, the memory budgets agreed across ranks,
the option chosen and its DeepSpeed config built. Shared by the Trainer's ``ZeroAutoStrategy`` and Fabric's
``ZeroAutoFabricStrategy``; no Lightning."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from lightspeed.core.deepspeed_config import (
    DeepSpeedConfigError,
    ZeroTuning,
    build_zero_config,
    check_zero_section,
    load_user_config,
    validate_keys,
)
from lightspeed.core.memory import (
    ZERO_OPTIONS,
    Accounting,
    Budgets,
    Cluster,
    MemoryPlanError,
    Plan,
    ZeroOption,
    count_parameters,
    explain_no_fit,
    plan,
)

__all__ = [
    "CHOSEN_BY_ZERO_AUTO",
    "agreed_budgets",
    "check_zero_auto_arguments",
    "choose_zero_option",
    "zero_auto_config",
]

CHOSEN_BY_ZERO_AUTO = ("stage", "offload_optimizer", "offload_param")
_TUNING_ARGUMENTS = tuple(field.name for field in dataclasses.fields(ZeroTuning))


def check_zero_auto_arguments(
    config: str | os.PathLike | dict[str, Any] | None, kwargs: dict[str, Any], safety_margin: float
) -> tuple[dict[str, Any], ZeroTuning]:
    """Check ``zero_auto``'s arguments and return the user's config and the tuning knobs; removes the knobs from
    ``kwargs`` (the rest are the front end's own arguments)."""
    for forbidden in ("stage", "offload_optimizer", "offload_parameters"):
        if forbidden in kwargs:
            raise DeepSpeedConfigError(
                f"zero_auto chooses `{forbidden}` itself. Remove it, or use a fixed strategy such as zero3 or "
                "stage=3 with offload_optimizer='cpu'."
            )
    user_config = load_user_config(config)
    check_zero_section(user_config)
    chosen_keys = [k for k in CHOSEN_BY_ZERO_AUTO if k in user_config.get("zero_optimization", {})]
    if chosen_keys:
        raise DeepSpeedConfigError(
            "zero_auto chooses the ZeRO stage and offload targets itself, but the DeepSpeed config sets "
            + ", ".join(f"zero_optimization.{k}" for k in chosen_keys)
            + ". Remove them, or use a fixed strategy (zero1 ... zero3_nvme)."
        )
    validate_keys(user_config)  # typos fail now; the full config is built once the option is chosen
    if not 0 <= safety_margin < 1:
        raise MemoryPlanError(f"safety_margin is a fraction of memory kept free, between 0 and 1; got {safety_margin}.")
    tuning = ZeroTuning(**{name: kwargs.pop(name) for name in _TUNING_ARGUMENTS if name in kwargs})
    return user_config, tuning


def agreed_budgets(local: Budgets) -> Budgets:
    """The smallest budgets over all ranks of the default process group, so every rank makes the same choice."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return local
    if torch.distributed.get_world_size() == 1:
        return local
    received: list[Budgets | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(received, local)
    gathered = [budgets for budgets in received if budgets is not None]  # every rank sent one

    def smallest(values: list[int | None]) -> int | None:
        known = [v for v in values if v is not None]
        return min(known) if known else None

    return Budgets(
        device_memory=smallest([b.device_memory for b in gathered]),
        host_memory=min(b.host_memory for b in gathered),
        nvme_free=smallest([b.nvme_free for b in gathered]) if all(b.nvme_free is not None for b in gathered) else None,
        nvme_unusable=next((b.nvme_unusable for b in gathered if b.nvme_unusable), None),
    )


def choose_zero_option(
    module: torch.nn.Module,
    cluster: Cluster,
    budgets: Budgets,
    precision: str,
    optimizer_state_bytes: int,
    safety_margin: float,
) -> tuple[Plan, ZeroOption]:
    """The memory plan for ``module`` and the fastest option that fits; raises :class:`MemoryPlanError` saying
    what to change when none does."""
    accounting = Accounting(precision=precision, optimizer_state_bytes=optimizer_state_bytes)
    result = plan(count_parameters(module), cluster, budgets, accounting, safety_margin, ZERO_OPTIONS)
    if result.choice is None:
        raise MemoryPlanError(explain_no_fit(result))
    return result, result.choice.estimate.option


def zero_auto_config(
    option: ZeroOption, user_config: dict[str, Any], tuning: ZeroTuning, nvme_path: str | None
) -> dict[str, Any]:
    """The (unresolved) DeepSpeed config of the chosen option with the user's config merged over it."""
    return build_zero_config(
        option.stage,
        option.offload_optimizer,
        option.offload_parameters,
        nvme_path=nvme_path,
        user_config=user_config,
        tuning=tuning.for_stage(option.stage),
    )
