"""Releasing a finished run's DeepSpeed engines, so that the memory they hold comes back to the process.

A DeepSpeed engine is never freed by dropping the last reference to it (DeepSpeed#4856, transformers#28178): its
gradient hooks live in C++ autograd nodes that Python's garbage collector cannot see through, ZeRO-3's parameter
coordinator caches modules in a class-level ``functools.lru_cache``, and ZeRO-3's forward hooks leave the top module
on a module-level stack. A notebook that trains twice, or a script that fits several Trainers, would keep every earlier
run's model, optimizer states and partitions alive (measured: +480 MiB per rank for a 50M model under ZeRO-2). So
lightspeed releases an engine once its run has ended and another begins: when its own run builds a new one for
training, and when another ZeRO run builds its engines in the process after the first run's front end tore down (a
Trainer after ``fit``; an evaluation on that Trainer afterwards raises :class:`~lightspeed.errors.EngineReleasedError`
instead of running a partitioned model without its hooks). Runs still going are never touched: a Fabric loop has no
end that Fabric reports, so its engines are released only with the process.
"""

from __future__ import annotations

import weakref
from typing import Any

from lightspeed.core.errors import EngineReleasedError
from lightspeed.core.zero.nvme_swapping import remove_swap_files

__all__ = ["EngineRecord", "release_engine"]

#: engines :func:`release_engine` has released (weakly: a released engine that nothing holds is freed)
_released: weakref.WeakSet[Any] = weakref.WeakSet()


def release_engine(engine: Any) -> None:
    """Free what holds ``engine`` beyond its owners' references: DeepSpeed's ``destroy()`` (gradient and ZeRO-3
    forward hooks), the engine's own hooks on the model, the ZeRO-3 coordinator's cache and forward-module stack;
    and its NVMe swap files.
    Calling the engine afterwards, or its ``load_checkpoint`` / ``save_checkpoint``, raises
    :class:`EngineReleasedError` (its ZeRO-3 weights are partitions without the hooks that gather them, its swap files
    are gone)."""
    if engine in _released:
        return
    _released.add(engine)
    remove_swap_files(engine)  # before destroy(), which lets go of the swappers that name the files
    engine.destroy()
    engine.forward = engine.load_checkpoint = engine.save_checkpoint = _refuse_released
    for name in ("module_forward_pre_hook", "module_forward_post_hook"):  # on the model, which may train again
        handle = getattr(engine, name, None)
        if handle is not None:
            handle.remove()
    modules = set(map(id, engine.module.modules())) if getattr(engine, "module", None) is not None else set()
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    stack = parameter_offload.FWD_MODULE_STACK
    stack[:] = [module for module in stack if id(module) not in modules]
    cached = PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
    for cell in getattr(cached, "__closure__", None) or ():  # DeepSpeed's nvtx wrapper around the lru_cache
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()


def _refuse_released(*args: Any, **kwargs: Any) -> Any:
    raise EngineReleasedError(
        "this DeepSpeed engine was released when its run built a new one or another ZeRO run started in this "
        "process (lightspeed frees an ended run's engines when the next run builds its own: DeepSpeed's engines are "
        "never freed otherwise). Evaluate before starting the next run, or with the new run's Trainer or Fabric after "
        "loading the weights from a checkpoint."
    )


class EngineRecord:
    """The engines ZeRO sessions built in this process, each under the session that built it, and which sessions have
    finished (their front end's teardown ran: a Trainer after ``fit``); everything held weakly."""

    _built: list[tuple[weakref.ref[Any], weakref.ref[Any]]] = []
    _finished: weakref.WeakSet[Any] = weakref.WeakSet()

    @classmethod
    def add(cls, session: object, engine: Any) -> None:
        """Note that ``session`` built ``engine``."""
        cls._built.append((weakref.ref(session), weakref.ref(engine)))

    @classmethod
    def set_finished(cls, session: object, finished: bool) -> None:
        """Note that ``session``'s run ended (its engines are kept only for a later evaluation) or runs again."""
        if finished:
            cls._finished.add(session)
        else:
            cls._finished.discard(session)

    @classmethod
    def release_finished_but(cls, session: object | None) -> None:
        """Release the engines of every finished session but ``session`` (which starts building its own). Engines of
        runs still going (a Fabric loop, which has no end, or runs taking turns in one process) are left alone."""
        kept: list[tuple[weakref.ref[Any], weakref.ref[Any]]] = []
        for builder_ref, engine_ref in cls._built:
            engine, builder = engine_ref(), builder_ref()
            if engine is None:
                continue
            if builder is session or (builder is not None and builder not in cls._finished):
                kept.append((builder_ref, engine_ref))
            else:
                release_engine(engine)
        cls._built[:] = kept
