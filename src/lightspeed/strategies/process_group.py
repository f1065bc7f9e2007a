"""The Trainer's side of lightspeed's process group (:mod:`lightspeed.core.reliability.process_group`), as a mixin
placed before a Lightning ``DDPStrategy`` or ``DeepSpeedStrategy``:

* ``setup_distributed``: lightspeed creates the default group (per-restart store prefix, heartbeat, timeouts also
  for DeepSpeed's groups) and Lightning or DeepSpeed adopts it;
* ``on_train_start``: the heartbeat publishes the step this rank is at;
* ``on_exception``: a collective that timed out becomes a :class:`~lightspeed.errors.CollectiveTimeoutError`
  naming the ranks that stopped answering, one that another rank's exit ended a
  :class:`~lightspeed.errors.RankLostError`;
* Lightning's SIGTERM handler keeps that error: torchrun sends SIGTERM to the remaining workers right after one
  failed, and the handler's broadcast on the broken group would otherwise raise gloo's bare "Connection closed by
  peer" in place of the error being handled (:func:`_sigterm_notifier_keeping_the_error`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from typing_extensions import override

from lightspeed.core.reliability import hang_report
from lightspeed.core.reliability import process_group as _process_group
from lightspeed.strategies.mixin_bases import ParallelStrategyBase

__all__ = ["ProcessGroupMixin"]

log = logging.getLogger(__name__)


class ProcessGroupMixin(ParallelStrategyBase):
    """lightspeed's process group under a Lightning ``DDPStrategy`` or ``DeepSpeedStrategy``; mix in first."""

    #: also set ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` before the group is created (DeepSpeed reads them)
    _rank_variables = False

    @contextmanager
    def _lightspeed_process_group(self) -> Iterator[None]:
        """Around Lightning's (or DeepSpeed's) process set-up: lightspeed's group is created first and adopted."""
        self.set_world_ranks()  # type: ignore[attr-defined]  # DDPStrategy's and DeepSpeedStrategy's
        backend = self._get_process_group_backend()  # type: ignore[attr-defined]
        timeout = self._timeout  # type: ignore[attr-defined]
        with _process_group.lightspeed_process_group(self, backend, timeout, rank_variables=self._rank_variables):
            yield
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is not None:  # before the Trainer registers its signal handlers (after the strategy's set-up)
            connector = trainer._signal_connector
            if not getattr(connector._sigterm_notifier_fn, "keeps_the_error", False):  # once per Trainer
                connector._sigterm_notifier_fn = _sigterm_notifier_keeping_the_error(connector._sigterm_notifier_fn)

    @override
    def setup_distributed(self) -> None:  # type: ignore[misc]  # DDPStrategy's and DeepSpeedStrategy's
        with self._lightspeed_process_group():
            super().setup_distributed()  # type: ignore[misc]

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        module = self.lightning_module
        assert module is not None
        _process_group.set_position(module.trainer, lambda trainer: f"step {trainer.global_step}")  # for the heartbeat

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        explained = _process_group.explain_timeout(exception)
        if explained is not None:
            raise explained from exception


def _sigterm_notifier_keeping_the_error(notifier: Callable[[int, FrameType | None], Any]) -> Callable[..., None]:
    """Lightning's SIGTERM notifier (it broadcasts rank 0's 'stop' to the others), made harmless on a group a rank
    has left: a signal handler's exception replaces whatever the main thread is doing, so the broadcast's "Connection
    closed by peer", raised while this rank handles the error of the collective the rank that left broke, would
    reach the user instead of lightspeed's :class:`~lightspeed.errors.RankLostError` naming that rank. Any other
    error of the notifier passes unchanged."""

    def notifier_keeping_the_error(signum: int, frame: FrameType | None) -> None:
        try:
            notifier(signum, frame)
        except Exception as error:
            if not hang_report.is_peer_lost(error):
                raise
            log.warning("SIGTERM received after another rank left the job; the broadcast of the stop was skipped")

    notifier_keeping_the_error.keeps_the_error = True  # type: ignore[attr-defined]
    return notifier_keeping_the_error
