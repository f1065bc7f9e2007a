"""Fabric's side of lightspeed's process group (:mod:`lightspeed.core.reliability.process_group`), as a mixin placed
before Lightning Fabric's ``DDPStrategy`` or ``DeepSpeedStrategy``; the Trainer's is
:mod:`lightspeed.strategies.process_group`.

* ``_setup_distributed``: lightspeed creates the default group (per-restart store prefix, heartbeat, timeouts also for
  DeepSpeed's groups) and Lightning or DeepSpeed adopts it; the heartbeat publishes the optimizer step this rank is at.
* Named hangs: Fabric has no exception hook, so every strategy call that can wait in a collective (the model's
  forward, ``fabric.backward``, ``optimizer.step()``, ``fabric.save``/``load``, ``all_reduce``, ``barrier``,
  ``broadcast``, ``all_gather``) turns a collective timeout into a :class:`~lightspeed.errors.CollectiveTimeoutError`
  naming the ranks that stopped answering.
* torchrun's SIGTERM, sent once another rank failed, waits until this rank has named the failure it is handling
  (:mod:`lightspeed.core.reliability.termination`; the Trainer has Lightning's handler).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.nn import Module
from typing_extensions import override

from lightspeed.core.reliability import process_group as _process_group
from lightspeed.core.reliability import termination
from lightspeed.fabric.mixin_bases import DDPStrategyBase

__all__ = ["ProcessGroupMixin"]


class ProcessGroupMixin(DDPStrategyBase):
    """lightspeed's process group under Fabric's ``DDPStrategy`` or ``DeepSpeedStrategy``; mix in first."""

    _optimizer_steps = 0

    #: also set ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` before the group is created (DeepSpeed reads them)
    _rank_variables = False

    @contextmanager
    def _lightspeed_process_group(self) -> Iterator[None]:
        """Around Fabric's (or DeepSpeed's) process set-up: lightspeed's group is created first and adopted."""
        self._set_world_ranks()
        with _process_group.lightspeed_process_group(
            self, self._get_process_group_backend(), self._timeout, rank_variables=self._rank_variables
        ):
            yield
        _process_group.set_position(self, lambda strategy: f"step {strategy._optimizer_steps}")  # for the heartbeat
        termination.name_failures_before_termination()  # Fabric has no SIGTERM handler of its own

    @override
    def _setup_distributed(self) -> None:
        with self._lightspeed_process_group():
            super()._setup_distributed()

    def _with_named_hangs(self, module: Module) -> Module:
        """``module`` whose forward names the ranks a timed-out collective waited for (ZeRO-3 gathers parameters,
        DDP may broadcast buffers)."""
        forward = module.forward

        def forward_with_named_hangs(*args: Any, **kwargs: Any) -> Any:
            with _process_group.timeouts_explained():
                return forward(*args, **kwargs)

        module.forward = forward_with_named_hangs
        return module

    @override
    def backward(self, tensor: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        with _process_group.timeouts_explained():
            super().backward(tensor, module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        with _process_group.timeouts_explained():
            result = super().optimizer_step(optimizer, **kwargs)
        self._optimizer_steps += 1
        return result

    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        with _process_group.timeouts_explained():
            return super().all_reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        with _process_group.timeouts_explained():
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with _process_group.timeouts_explained():
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with _process_group.timeouts_explained():
            return super().broadcast(obj, src)

    @override
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        with _process_group.timeouts_explained():
            super().save_checkpoint(*args, **kwargs)

    @override
    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        with _process_group.timeouts_explained():
            return super().load_checkpoint(*args, **kwargs)
