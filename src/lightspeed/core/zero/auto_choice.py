"""``zero_auto``'s decisions without a Lightning loop: its arguments checked, the memory budgets agreed across ranks,
the option chosen and its DeepSpeed config built. Shared by the Trainer's ``ZeroAutoStrategy`` and Fabric's
``ZeroAutoFabricStrategy``; no Lightning."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from lightspeed.core.common.sizes import parse_size
from lightspeed.core.errors import DeepSpeedConfigError, MemoryPlanError
from lightspeed.core.zero.config import (
    NVME_PATH_ENV,
    ZeroTuning,
    build_zero_config,
    check_zero_section,
    config_or_environment,
    load_user_config,
    validate_keys,
)
from lightspeed.core.zero.planner import (
    ZERO_OPTIONS,
    Accounting,
    Budgets,
    Cluster,
    Plan,
    ZeroOption,
    count_parameters,
    explain_no_fit,
    measure_budgets,
    plan,
)
from lightspeed.core.zero.planner.report import format_table

__all__ = [
    "CHOSEN_BY_ZERO_AUTO",
    "ZeroAutoDecision",
    "ZeroAutoRequest",
    "agreed_budgets",
    "check_zero_auto_arguments",
    "choose_zero_option",
    "zero_auto_config",
]

CHOSEN_BY_ZERO_AUTO = ("stage", "offload_optimizer", "offload_param")
_TUNING_ARGUMENTS = tuple(field.name for field in dataclasses.fields(ZeroTuning))


def check_zero_auto_arguments(
    config: str | os.PathLike | dict[str, Any] | None,
    kwargs: dict[str, Any],
    safety_margin: float,
    front_end: str = "Trainer",
) -> tuple[dict[str, Any], ZeroTuning]:
    """Check ``zero_auto``'s arguments and return the user's config and the tuning knobs; removes the knobs from
    ``kwargs`` (the rest are the front end's own arguments)."""
    for forbidden in ("stage", "offload_optimizer", "offload_parameters"):
        if forbidden in kwargs:
            raise DeepSpeedConfigError(
                f"zero_auto chooses `{forbidden}` itself. Remove it, or use a fixed strategy such as zero3 or "
                "stage=3 with offload_optimizer='cpu'."
            )
    user_config = load_user_config(config_or_environment(config))
    check_zero_section(user_config)
    chosen_keys = [k for k in CHOSEN_BY_ZERO_AUTO if k in user_config.get("zero_optimization", {})]
    if chosen_keys:
        raise DeepSpeedConfigError(
            "zero_auto chooses the ZeRO stage and offload targets itself, but the DeepSpeed config sets "
            + ", ".join(f"zero_optimization.{k}" for k in chosen_keys)
            + ". Remove them, or use a fixed strategy (zero1 ... zero3_nvme)."
        )
    validate_keys(user_config, front_end)  # typos fail now; the full config is built once the option is chosen
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
    tuning: ZeroTuning | None = None,
    accumulate_grad_batches: int | None = None,
) -> tuple[Plan, ZeroOption]:
    """The memory plan for ``module`` and the fastest option that fits (with the low-memory bf16 states ``tuning``
    asks for; ``accumulate_grad_batches`` None where the front end does not know it); raises
    :class:`MemoryPlanError` saying what to change when none does."""
    tuning = tuning or ZeroTuning()
    accounting = Accounting(
        precision=precision,
        optimizer_state_bytes=optimizer_state_bytes,
        accumulate_grad_batches=accumulate_grad_batches,
        bf16_master_weights_and_grads=tuning.bf16_master_weights_and_grads,
        bf16_optimizer_states=tuning.bf16_optimizer_states,
    )
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


@dataclasses.dataclass(frozen=True)
class ZeroAutoDecision:
    """What ``zero_auto`` chose: the memory plan (logged as a table), the option and its unresolved config."""

    plan: Plan
    option: ZeroOption
    config: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ZeroAutoRequest:
    """``zero_auto``'s arguments, checked once, and the choice made from them: the same for the Trainer's and
    Fabric's strategy. ``device_memory``/``host_memory`` are bytes (None: measured), ``nvme_path`` allows NVMe
    offload as the last resort."""

    safety_margin: float
    device_memory: int | None
    host_memory: int | None
    nvme_path: str | None
    optimizer_state_bytes: int
    user_config: dict[str, Any]
    tuning: ZeroTuning

    @classmethod
    def from_arguments(
        cls,
        *,
        safety_margin: float,
        device_memory: int | str | None,
        host_memory: int | str | None,
        nvme_path: str | None,
        optimizer_state_bytes: int,
        config: str | os.PathLike | dict[str, Any] | None,
        kwargs: dict[str, Any],
        front_end: str = "Trainer",
    ) -> ZeroAutoRequest:
        """Check the arguments (the tuning knobs are removed from ``kwargs``; the rest are the front end's own)."""
        user_config, tuning = check_zero_auto_arguments(config, kwargs, safety_margin, front_end)
        return cls(
            safety_margin=safety_margin,
            device_memory=None
            if device_memory is None
            else parse_size(device_memory, "device_memory", MemoryPlanError),
            host_memory=None if host_memory is None else parse_size(host_memory, "host_memory", MemoryPlanError),
            nvme_path=nvme_path if nvme_path is not None else os.environ.get(NVME_PATH_ENV),
            optimizer_state_bytes=optimizer_state_bytes,
            user_config=user_config,
            tuning=tuning,
        )

    def decide(
        self,
        module: torch.nn.Module,
        devices_per_node: int,
        nodes: int,
        precision: str,
        device: torch.device | None,
        info: Callable[[str], None],
        accumulate_grad_batches: int | None = None,
    ) -> ZeroAutoDecision:
        """Measure this rank's budgets (overrides first), agree on the smallest over all ranks (a collective), plan,
        choose and log the plan's table through ``info``; raises :class:`MemoryPlanError` when nothing fits.
        ``accumulate_grad_batches``: the micro-batches of a step (None: not known, planned as several)."""
        budgets = agreed_budgets(measure_budgets(self.device_memory, self.host_memory, self.nvme_path, device=device))
        cluster = Cluster(devices_per_node=max(1, devices_per_node), nodes=max(1, nodes))
        result, option = choose_zero_option(
            module,
            cluster,
            budgets,
            precision,
            self.optimizer_state_bytes,
            self.safety_margin,
            self.tuning,
            accumulate_grad_batches,
        )
        info(f"lightspeed zero_auto: memory plan\n{format_table(result)}")
        return ZeroAutoDecision(result, option, zero_auto_config(option, self.user_config, self.tuning, self.nvme_path))
