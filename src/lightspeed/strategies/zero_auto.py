"""``zero_auto``: a ZeRO strategy that measures the model and the machine at setup and configures itself as the
fastest ZeRO option that fits (see :mod:`lightspeed.core.memory`), logging the table and the choice.

The choice is made when the DeepSpeed config is first needed: in ``configure_model`` (Lightning's
``model_sharded_context``) when the model already has its parameters, else in ``setup`` after ``configure_model``
built them in full (then ZeRO-3 partitions them at ``deepspeed.initialize``). Every rank measures its own devices
and host memory; the smallest budgets across ranks decide, so all ranks make the same choice.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightspeed.core.deepspeed_config import (
    NVME_PATH_ENV,
    DeepSpeedConfigError,
    ZeroTuning,
    build_zero_config,
    check_zero_section,
    load_user_config,
    validate_keys,
)
from lightspeed.core.memory import (
    DEFAULT_SAFETY_MARGIN,
    ZERO_OPTIONS,
    Accounting,
    Budgets,
    Cluster,
    MemoryPlanError,
    Plan,
    ZeroOption,
    count_parameters,
    explain_no_fit,
    format_table,
    measure_budgets,
    parse_size,
    plan,
)
from lightspeed.strategies.zero import ZeroStrategy

__all__ = ["ZeroAutoStrategy"]

log = logging.getLogger(__name__)

_CHOSEN_BY_ZERO_AUTO = ("stage", "offload_optimizer", "offload_param")
_TUNING_ARGUMENTS = tuple(field.name for field in dataclasses.fields(ZeroTuning))


class ZeroAutoStrategy(ZeroStrategy):
    """ZeRO with the stage and offload chosen from the model size and the memory of this machine.

    Args:
        safety_margin: fraction of every memory budget kept free for activations, buffers and fragmentation.
        device_memory: memory per device to plan with (bytes or a size like ``"24GB"``) instead of the free memory
            measured on the GPUs; on the CPU the processes share host memory, so leave it unset.
        host_memory: host memory per node to plan with instead of what is available now.
        nvme_path: allows NVMe offload (as the last resort) into this directory; default ``$LIGHTSPEED_NVME_PATH``.
        optimizer_state_bytes: optimizer state per parameter (8: Adam/AdamW; 4: SGD with momentum).
        config: a DeepSpeed config merged over the chosen preset; it must not set the stage or offload targets.
        **kwargs: the other :class:`ZeroStrategy` arguments: ``pin_memory``, the bucket sizes, ``sub_group_size``
            (applied to whichever stage is chosen, where that stage has them) and Lightning's.
    """

    strategy_name = "zero_auto"

    def __init__(
        self,
        safety_margin: float = DEFAULT_SAFETY_MARGIN,
        device_memory: int | str | None = None,
        host_memory: int | str | None = None,
        nvme_path: str | None = None,
        optimizer_state_bytes: int = 8,
        config: str | os.PathLike | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        for forbidden in ("stage", "offload_optimizer", "offload_parameters"):
            if forbidden in kwargs:
                raise DeepSpeedConfigError(
                    f"zero_auto chooses `{forbidden}` itself. Remove it, or use a fixed strategy such as "
                    "ZeroStrategy(stage=3, offload_optimizer='cpu')."
                )
        user_config = load_user_config(config)
        check_zero_section(user_config)
        chosen_keys = [k for k in _CHOSEN_BY_ZERO_AUTO if k in user_config.get("zero_optimization", {})]
        if chosen_keys:
            raise DeepSpeedConfigError(
                "zero_auto chooses the ZeRO stage and offload targets itself, but the DeepSpeed config sets "
                + ", ".join(f"zero_optimization.{k}" for k in chosen_keys)
                + ". Remove them, or use a fixed strategy (zero1 ... zero3_nvme)."
            )
        validate_keys(user_config)  # typos fail now; the full config is built once the option is chosen
        inspect.signature(ZeroStrategy).bind_partial(**kwargs)  # a misspelt argument is a TypeError naming it
        tuning = ZeroTuning(**{name: kwargs.pop(name) for name in _TUNING_ARGUMENTS if name in kwargs})
        if not 0 <= safety_margin < 1:
            raise MemoryPlanError(
                f"safety_margin is a fraction of memory kept free, between 0 and 1; got {safety_margin}."
            )
        self._init_lightning(user_config, **kwargs)
        self.safety_margin = safety_margin
        self.device_memory = parse_size(device_memory, "device_memory") if device_memory is not None else None
        self.host_memory = parse_size(host_memory, "host_memory") if host_memory is not None else None
        self.nvme_path = nvme_path if nvme_path is not None else os.environ.get(NVME_PATH_ENV)
        self.optimizer_state_bytes = optimizer_state_bytes
        self._user_config = user_config
        self._tuning = tuning
        self.memory_plan: Plan | None = None
        self.chosen_option: ZeroOption | None = None

    # ------------------------------------------------------------------ measuring
    def _model_has_parameters(self) -> bool:
        module = self.lightning_module
        return module is not None and any(True for _ in module.parameters())

    def _local_budgets(self) -> Budgets:
        """This rank's view of the budgets: overrides first, else measured on its own device and host."""
        return measure_budgets(self.device_memory, self.host_memory, self.nvme_path, device=self.root_device)

    def _agreed_budgets(self) -> Budgets:
        """The smallest budgets over all ranks, so every rank makes the same choice."""
        local = self._local_budgets()
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or self.world_size == 1:
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
            nvme_free=smallest([b.nvme_free for b in gathered])
            if all(b.nvme_free is not None for b in gathered)
            else None,
            nvme_unusable=next((b.nvme_unusable for b in gathered if b.nvme_unusable), None),
        )

    def _cluster(self) -> Cluster:
        devices = len(self.parallel_devices) if self.parallel_devices else 1
        return Cluster(devices_per_node=devices, nodes=max(1, self.num_nodes))

    # ------------------------------------------------------------------ choosing
    def choose(self) -> ZeroOption:
        """Measure, plan, log the table and configure this strategy as the chosen option."""
        counts = count_parameters(self._module())
        accounting = Accounting(
            precision=self.precision_plugin.precision, optimizer_state_bytes=self.optimizer_state_bytes
        )
        result = plan(counts, self._cluster(), self._agreed_budgets(), accounting, self.safety_margin, ZERO_OPTIONS)
        self.memory_plan = result
        if result.choice is None:
            raise MemoryPlanError(explain_no_fit(result))
        option = result.choice.estimate.option
        rank_zero_info(f"lightspeed zero_auto: memory plan\n{format_table(result)}")
        self._configure_as(option)
        self.chosen_option = option
        return option

    def _configure_as(self, option: ZeroOption) -> None:
        self.config = build_zero_config(
            option.stage,
            option.offload_optimizer,
            option.offload_parameters,
            nvme_path=self.nvme_path,
            user_config=self._user_config,
            tuning=self._tuning.for_stage(option.stage),
        )

    # ------------------------------------------------------------------ hooks
    @override
    def _format_config(self) -> None:
        if self.chosen_option is None:
            self.choose()
        super()._format_config()

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        if self.chosen_option is None and not self._model_has_parameters():
            # the layers are created in configure_model: build them in full, measure and choose afterwards
            yield
            return
        with super().model_sharded_context():
            yield
