"""The Trainer's side of lightspeed's process group (:mod:`lightspeed.core.reliability.process_group`), as a mixin
placed before a Lightning ``DDPStrategy`` or ``DeepSpeedStrategy``:

* ``setup_distributed``: lightspeed creates the default group (per-restart store prefix, heartbeat, timeouts also
  for DeepSpeed's groups) and Lightning or DeepSpeed adopts it;
* ``on_train_start``: the heartbeat publishes the step this rank is at;
* ``on_exception``: a collective that timed out becomes a :class:`~lightspeed.errors.CollectiveTimeoutError`
  naming the ranks that stopped answering.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from typing_extensions import override

from lightspeed.core.reliability import process_group as _process_group

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy

    _ParallelStrategyBase = ParallelStrategy  # type-checked as the Lightning strategy it is mixed into
else:
    _ParallelStrategyBase = object

__all__ = ["ProcessGroupMixin"]


class ProcessGroupMixin(_ParallelStrategyBase):
    """lightspeed's process group under a Lightning ``DDPStrategy`` or ``DeepSpeedStrategy``; mix in first."""

    def _set_main_address(self) -> None:
        """``MASTER_ADDR``/``MASTER_PORT`` (and for DeepSpeed the rank variables) before the group is created."""
        assert self.cluster_environment is not None
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)

    @contextmanager
    def _lightspeed_process_group(self) -> Iterator[None]:
        """Around Lightning's (or DeepSpeed's) process set-up: lightspeed's group is created first and adopted."""
        self.set_world_ranks()  # type: ignore[attr-defined]  # DDPStrategy's and DeepSpeedStrategy's
        with _process_group.lightspeed_process_group(
            self._get_process_group_backend(),  # type: ignore[attr-defined]
            self.global_rank,
            self.world_size,
            self._timeout,  # type: ignore[attr-defined]
            before_creating=self._set_main_address,
        ):
            yield

    @override
    def setup_distributed(self) -> None:  # type: ignore[misc]  # DDPStrategy's and DeepSpeedStrategy's
        with self._lightspeed_process_group():
            super().setup_distributed()  # type: ignore[misc]

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        _process_group.set_position(lambda: f"step {trainer.global_step}")  # published with the heartbeat

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        explained = _process_group.explain_timeout(exception)
        if explained is not None:
            raise explained from exception
