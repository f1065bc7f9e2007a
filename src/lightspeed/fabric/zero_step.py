"""The optimizer step of a Fabric loop under ZeRO: where an accumulation window ends
(``fabric.no_backward_sync``), and clipping and scaling the gradients, which ZeRO does inside its next step (on the
partitioned gradients), through the session."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.accumulation import set_deepspeed_boundary
from lightspeed.fabric.mixin_bases import DeepSpeedStrategyBase

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from lightspeed.core.zero.session import ZeroSession


__all__ = ["ZeroBackwardSyncControl", "ZeroStepMixin"]


class ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled=...)`` under ZeRO: the engine learns that the backward passes inside
    the block do not close the accumulation window, so every stage accumulates them and the first backward outside
    reduces the whole window (Lightning's DeepSpeed strategy ignores the call, which leaves ZeRO-1/2 about 1e-2 off
    the big-batch step)."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return _inside_the_window(module) if enabled else nullcontext()


@contextmanager
def _inside_the_window(engine: Any) -> Iterator[None]:
    set_deepspeed_boundary(engine, False)
    try:
        yield
    finally:
        set_deepspeed_boundary(engine, True)


class ZeroStepMixin(DeepSpeedStrategyBase):
    """``fabric.clip_gradients`` and the exact-accumulation factor of :class:`~lightspeed.fabric.ZeroFabricStrategy`,
    applied inside the next ``optimizer.step()`` (mixed in before Lightning Fabric's ``DeepSpeedStrategy``)."""

    _session: ZeroSession

    @override
    def clip_gradients_norm(
        self,
        module: DeepSpeedEngine,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip the gradient norm to ``max_norm`` in DeepSpeed's next ``optimizer.step()`` (ZeRO clips there, on the
        partitioned gradients). Returns the total norm of the gradients before clipping, as Lightning's strategies
        do: a scalar tensor that the next ``optimizer.step()`` fills in (ZeRO measures the norm of the partitioned
        gradients during the step; NaN until then)."""
        if float(norm_type) != 2.0:
            raise DeepSpeedConfigError(
                f"DeepSpeed clips by the 2-norm only, but `fabric.clip_gradients(norm_type={norm_type})` was called. "
                "Drop norm_type."
            )
        configured = self._session.config.get("gradient_clipping", 0.0) or 0.0
        if configured and float(configured) != float(max_norm):
            raise DeepSpeedConfigError(
                f"gradient_clipping={configured} in the DeepSpeed config, but "
                f'`fabric.clip_gradients(max_norm={max_norm})`. Make them agree: set gradient_clipping to "auto" '
                "(or remove it) to clip per call, or call clip_gradients with the configured value."
            )
        return self._session.clip_at_step(self._engine_for(module), float(max_norm))

    @override
    def clip_gradients_value(self, module: DeepSpeedEngine, optimizer: Optimizer, clip_val: float | int) -> None:
        raise DeepSpeedConfigError(
            f"`fabric.clip_gradients(clip_val={clip_val})` clips each gradient element by value, which DeepSpeed's "
            "ZeRO optimizers cannot do (they only clip the norm of the partitioned gradients). Use "
            f"`fabric.clip_gradients(model, optimizer, max_norm={clip_val})`."
        )

    def scale_next_step(self, factor: float, engine: Any = None) -> None:
        """Multiply the gradients the next ``optimizer.step()`` of ``engine`` (default: the last one used) uses by
        ``factor`` (inside the ZeRO optimizer, before clipping); used by :func:`lightspeed.fabric.accumulate` to close
        an exact accumulation window."""
        self._session.scale_at_step(engine or self.model, factor)

    @property
    def step_pending(self) -> bool:
        """True while a per-step override (window factor, clipping) waits for ``optimizer.step()``."""
        return self._session.step_pending

    def _engine_for(self, module: Any) -> Any:
        return module if hasattr(module, "set_gradient_accumulation_boundary") else self.model
