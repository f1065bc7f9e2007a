"""A model compiled with ``torch.compile`` before ``fabric.setup``, compiled the DeepSpeed way.

``fabric.setup`` unwraps a model compiled with ``torch.compile`` before handing it to the strategy, then compiles what
the strategy returned (``torch.compile(engine, **kwargs)``: DeepSpeed's whole forward, hooks included) and wraps that
in its ``_FabricModule``, all after the strategy returns. :class:`FabricCompileTakeover` arms a one-shot module
registration hook that sees the ``_FabricModule`` take the compiled engine, compiles the engine with
``engine.compile()`` and the same ``torch.compile`` arguments instead (the strategy's own, when it has them), and
hands Fabric the engine itself.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, cast

from lightning.fabric.wrappers import _FabricModule
from torch._dynamo import OptimizedModule
from torch.nn import Module
from torch.nn.modules.module import register_module_module_registration_hook

from lightspeed.core.zero.compile import check_compile_supported, check_zero3_module_compiles, request_from_kwargs

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from lightspeed.core.zero.session import ZeroSession

__all__ = ["FabricCompileTakeover"]

_ZERO3_LATE_COMPILE = (
    "Hand `fabric.setup` the model uncompiled, with `ZeroFabricStrategy(stage=3, ..., compile=True)` (lightspeed marks "
    "them before building the engine), or mark them yourself before `fabric.setup`: "
    "`deepspeed.utils.set_z3_leaf_modules(model, [torch.nn.MultiheadAttention])`."
)


class FabricCompileTakeover:
    """The hook armed for the engine of the last ``fabric.setup`` (at most one at a time)."""

    def __init__(self) -> None:
        self._hook: RemovableHandle | None = None

    def arm(self, session: ZeroSession, engine: Any, device_kind: str) -> None:
        """Catch Fabric compiling ``engine`` (built by ``session``) once ``fabric.setup`` returns it."""
        self.drop()
        armed = True
        owner, set_up = weakref.ref(session), weakref.ref(engine)  # an armed hook keeps neither alive

        def take_over_fabric_compile(parent: Module, name: str, submodule: Module | None) -> Module | None:
            nonlocal armed
            if not armed or name != "_forward_module" or not isinstance(parent, _FabricModule):
                return None
            armed = False  # the first _FabricModule after this setup; the hook itself goes at the next step
            engine, session = set_up(), owner()
            if engine is None or session is None:
                return None
            if not (isinstance(submodule, OptimizedModule) and submodule._orig_mod is engine):
                return None
            # (Lightning's torch.compile records its arguments as `_compile_kwargs` on the module it compiled, i.e.
            # on the engine, where DeepSpeed keeps those of engine.compile(): read them, then compile over them)
            request = request_from_kwargs(getattr(submodule, "_compile_kwargs", None), "torch.compile(model)")
            if engine.is_compiled and session.compiled_with is not None:  # compiled by the strategy's arguments
                cast(Any, engine)._compile_kwargs = dict(session.compiled_with.kwargs)
                return engine
            check_compile_supported(request, session.config, device_kind)
            wrapped = engine.module
            assert isinstance(wrapped, Module)
            check_zero3_module_compiles(request, wrapped, session.config, instead=_ZERO3_LATE_COMPILE)
            session.compile(engine, request)
            return engine

        # (a hook cannot remove itself: torch is iterating over the hooks while it runs). torch types the hook as
        # returning None, but uses a returned module in place of the one assigned
        self._hook = register_module_module_registration_hook(take_over_fabric_compile)  # type: ignore[arg-type]

    def drop(self) -> None:
        """Remove the hook (the next optimizer step: ``fabric.setup`` is over; the strategy's teardown)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
