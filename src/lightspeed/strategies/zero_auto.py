"""``zero_auto``: a ZeRO strategy that measures the model and the machine at setup and configures itself as the
fastest ZeRO option that fits (see :mod:`lightspeed.core.zero.planner`), logging the table and the choice.

The choice is made when the DeepSpeed config is first needed: in ``configure_model`` (Lightning's
``model_sharded_context``) when the model already has its parameters, else in ``setup`` after ``configure_model``
built them in full (then ZeRO-3 partitions them at ``deepspeed.initialize``). Every rank measures its own devices
and host memory; the smallest budgets across ranks decide, so all ranks make the same choice.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightspeed.core.zero.auto_choice import ZeroAutoRequest
from lightspeed.core.zero.planner import DEFAULT_SAFETY_MARGIN, Cluster, Plan, ZeroOption, format_table
from lightspeed.strategies.zero import ZeroStrategy

__all__ = ["ZeroAutoStrategy"]


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
        self.request = ZeroAutoRequest.from_arguments(
            safety_margin=safety_margin,
            device_memory=device_memory,
            host_memory=host_memory,
            nvme_path=nvme_path,
            optimizer_state_bytes=optimizer_state_bytes,
            config=config,
            kwargs=kwargs,
        )
        inspect.signature(ZeroStrategy).bind_partial(**kwargs)  # a misspelt argument is a TypeError naming it
        self._init_lightning(self.request.user_config, **kwargs)
        self.memory_plan: Plan | None = None
        self.chosen_option: ZeroOption | None = None

    # ------------------------------------------------------------------ measuring and choosing
    def _model_has_parameters(self) -> bool:
        module = self.lightning_module
        return module is not None and any(True for _ in module.parameters())

    def choose(self) -> ZeroOption:
        """Measure, plan, log the table and configure this strategy as the chosen option."""
        devices = len(self.parallel_devices) if self.parallel_devices else 1
        decision = self.request.decide(
            self._module(),
            Cluster(devices_per_node=devices, nodes=max(1, self.num_nodes)),
            self.precision_plugin.precision,
            self.root_device,
        )
        self.memory_plan = decision.plan
        rank_zero_info(f"lightspeed zero_auto: memory plan\n{format_table(decision.plan)}")
        self.config = decision.config
        self.chosen_option = decision.option
        return decision.option

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
