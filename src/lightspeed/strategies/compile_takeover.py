"""A LightningModule compiled with ``torch.compile`` before ``fit``, compiled the DeepSpeed way (the sibling of
:mod:`lightspeed.fabric.compile_takeover`).

The Trainer unwraps a compiled module (``from_compiled``, which compiles its step methods instead), assigns it to the
strategy's ``_lightning_module`` and then refuses a compiled module under any DeepSpeed strategy.
:class:`CompileTakeoverMixin` catches that assignment: it reads the ``torch.compile`` arguments, undoes Lightning's
per-method wrapping and hands the request to the session, whose engine compiles the module with ``engine.compile()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities.compile import to_uncompiled
from typing_extensions import override

from lightspeed.core.zero.compile import CompileRequest, request_from_dynamo_context
from lightspeed.core.zero.runtime import zero_device_kind
from lightspeed.strategies.mixin_bases import DeepSpeedStrategyBase

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightspeed.core.zero.session import ZeroSession

__all__ = ["CompileTakeoverMixin"]


class CompileTakeoverMixin(DeepSpeedStrategyBase):
    """``torch.compile`` of the LightningModule through the engine; mix in before Lightning's ``DeepSpeedStrategy``."""

    _session: ZeroSession

    @property
    @override
    def _lightning_module(self) -> pl.LightningModule | None:
        return self.__dict__.get("_zero_lightning_module")

    @_lightning_module.setter
    def _lightning_module(self, module: pl.LightningModule | None) -> None:
        ctx = getattr(module, "_compiler_ctx", None) if module is not None else None
        if module is not None and ctx is not None:
            request = request_from_dynamo_context(ctx["dynamo_ctx"], "torch.compile(model)")
            to_uncompiled(module)
            kind = zero_device_kind(self.accelerator) if self.accelerator is not None else None
            self._session.take_over_compile(request, kind)
        self.__dict__["_zero_lightning_module"] = module

    @property
    def compile_request(self) -> CompileRequest | None:
        """What ``engine.compile()`` is called with (None: the model is not compiled)."""
        return self._session.compile_request
