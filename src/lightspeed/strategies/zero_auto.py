"""``zero_auto``: a ZeRO strategy that measures the model and the machine at setup and configures itself as the
fastest ZeRO option that fits (see :mod:`lightspeed.core.memory`), logging the table and the choice.

The choice is made when the DeepSpeed config is first needed: in ``configure_model`` (Lightning's
``model_sharded_context``) when the model already has its parameters, else in ``setup`` after ``configure_model``
built them in full (then ZeRO-3 partitions them at ``deepspeed.initialize``). Every rank measures its own devices
and host memory; the smallest budgets across ranks decide, so all ranks make the same choice.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightspeed.core.deepspeed_config import (
    NVME_PATH_ENV,
)
from lightspeed.core.memory import (
    DEFAULT_SAFETY_MARGIN,
    Budgets,
    Cluster,
    Plan,
    ZeroOption,
    format_table,
    measure_budgets,
    parse_size,
)
from lightspeed.core.zero_auto_choice import (
    agreed_budgets,
    check_zero_auto_arguments,
    choose_zero_option,
    zero_auto_config,
)
from lightspeed.strategies.zero import ZeroStrategy

__all__ = ["ZeroAutoStrategy"]

log = logging.getLogger(__name__)


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
        user_config, tuning = check_zero_auto_arguments(config, kwargs, safety_margin)
        inspect.signature(ZeroStrategy).bind_partial(**kwargs)  # a misspelt argument is a TypeError naming it
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
        return agreed_budgets(self._local_budgets())

    def _cluster(self) -> Cluster:
        devices = len(self.parallel_devices) if self.parallel_devices else 1
        return Cluster(devices_per_node=devices, nodes=max(1, self.num_nodes))

    # ------------------------------------------------------------------ choosing
    def choose(self) -> ZeroOption:
        """Measure, plan, log the table and configure this strategy as the chosen option."""
        result, option = choose_zero_option(
            self._module(),
            self._cluster(),
            self._agreed_budgets(),
            self.precision_plugin.precision,
            self.optimizer_state_bytes,
            self.safety_margin,
        )
        self.memory_plan = result
        rank_zero_info(f"lightspeed zero_auto: memory plan\n{format_table(result)}")
        self._configure_as(option)
        self.chosen_option = option
        return option

    def _configure_as(self, option: ZeroOption) -> None:
        self.config = zero_auto_config(option, self._user_config, self._tuning, self.nvme_path)

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
