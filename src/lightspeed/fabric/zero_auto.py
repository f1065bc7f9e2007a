"""``zero_auto`` for Lightning Fabric: the ZeRO stage and offload chosen at ``fabric.setup`` from the model's size and
this machine's memory (the Trainer's is :mod:`lightspeed.strategies.zero_auto`; both call
:class:`~lightspeed.core.zero.auto_choice.ZeroAutoRequest`)."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightspeed.core.zero.auto_choice import ZeroAutoRequest
from lightspeed.core.zero.engine import one_optimizer_error
from lightspeed.core.zero.planner import DEFAULT_SAFETY_MARGIN, Cluster, Plan, ZeroOption, format_table
from lightspeed.fabric.zero import ZeroFabricStrategy, unknown_keywords_error

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

__all__ = ["ZeroAutoFabricStrategy"]

#: the Fabric strategy arguments zero_auto passes on to ZeroFabricStrategy
_FABRIC_STRATEGY_ARGUMENTS = frozenset(
    {
        "pin_memory",
        "accelerator",
        "parallel_devices",
        "cluster_environment",
        "precision",
        "process_group_backend",
        "timeout",
        "logging_level",
        "exclude_frozen_parameters",
        "load_full_weights",
        "node_local_storage",
    }
)


class ZeroAutoFabricStrategy(ZeroFabricStrategy):
    """``zero_auto`` for Fabric: the ZeRO stage and offload are chosen at ``fabric.setup`` from the model's size and
    this machine's memory (the smallest budgets over all ranks), logged as a table.

    Under ``fabric.init_module()`` the model is built in full (the choice needs it); ``deepspeed.initialize`` then
    partitions it if ZeRO-3 is chosen. Arguments as the Trainer's :class:`~lightspeed.strategies.ZeroAutoStrategy`.
    """

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
        self.request = ZeroAutoRequest.from_arguments(
            safety_margin=safety_margin,
            device_memory=device_memory,
            host_memory=host_memory,
            nvme_path=nvme_path,
            optimizer_state_bytes=optimizer_state_bytes,
            config=config,
            kwargs=kwargs,
            front_end="Fabric",
        )
        unknown = {name: value for name, value in kwargs.items() if name not in _FABRIC_STRATEGY_ARGUMENTS}
        if unknown:
            raise unknown_keywords_error(type(self).__name__, unknown)
        self._init_lightning(self.request.user_config, **kwargs)
        self.memory_plan: Plan | None = None
        self.chosen_option: ZeroOption | None = None

    def choose(self, module: Module) -> ZeroOption:
        """Measure, plan, log the table and configure this strategy as the chosen option."""
        devices = len(self.parallel_devices) if self.parallel_devices else 1
        decision = self.request.decide(
            module,
            Cluster(devices_per_node=devices, nodes=max(1, self.num_nodes)),
            self.precision.precision,
            self.root_device,
        )
        self.memory_plan = decision.plan
        rank_zero_info(f"lightspeed zero_auto: memory plan\n{format_table(decision.plan)}")
        self._recipe = decision.config
        self.config = self._recipe
        self.chosen_option = decision.option
        return decision.option

    @override
    def _format_config(self) -> None:
        if self.chosen_option is not None:
            super()._format_config()
        # else: nothing to resolve until the model is known (fabric.setup chooses)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        if self.chosen_option is None:
            # the choice needs the model: build it in full; deepspeed.initialize partitions it under ZeRO-3
            return DDPStrategy.module_init_context(self, empty_init=empty_init)
        return super().module_init_context(empty_init=empty_init)

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[DeepSpeedEngine, list[Optimizer], Any]:
        if len(optimizers) != 1:
            raise one_optimizer_error(f"{len(optimizers)} optimizers", "`fabric.setup` got")
        if self.chosen_option is None:
            self.choose(module)
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    @override
    def setup_module(self, module: Module) -> DeepSpeedEngine:
        if self.chosen_option is None:
            self.choose(module)
        return super().setup_module(module)
