"""Generation under ZeRO-3 that cannot hang.

Under ZeRO-3 every forward pass gathers each layer's parameters from all ranks, so every rank must run the same
number of forward passes. Autoregressive generation breaks that as soon as the ranks' sequences end at different steps
(an end-of-sequence token, another ``max_new_tokens``): the rank that stopped leaves the others waiting in a gather
forever. HuggingFace's ``generate`` keeps going with dummy forward passes until every rank is done when it is called
with ``synced_gpus=True``, which users have to know to pass. :func:`keep_generation_in_step` makes it the default for
every ``generate`` method of a model's modules while their parameters are partitioned over several processes, and
refuses ``synced_gpus=False`` there. :func:`gathered_for_generation` gathers the parameters once for a whole
generation instead of once per token, when memory allows. Inside :func:`forward_without_collectives` (what
:func:`~lightspeed.core.zero.evaluation.gathered_for_evaluation` opens when the ranks run different numbers of
evaluation batches) the parameters are already whole and forward passes make no collective, so ``generate`` runs
without ``synced_gpus`` (unless it is passed) and ``gathered_for_generation`` gathers nothing more.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "GATHER_MEMORY_SHARE",
    "GRAD_INSIDE_GATHERED_ERROR",
    "SYNCED_GPUS_FALSE_ERROR",
    "forward_without_collectives",
    "gathered_for_generation",
    "keep_generation_in_step",
    "partitioned_over_ranks",
    "runs_without_collectives",
]

SYNCED_GPUS_FALSE_ERROR = (
    "`generate(synced_gpus=False)` on a model partitioned by ZeRO-3 over {world} processes: every forward pass gathers "
    "the parameters from all ranks, so a rank whose sequences end earlier than another's leaves it waiting forever. "
    "Drop `synced_gpus` (lightspeed passes synced_gpus=True under ZeRO-3) or pass synced_gpus=True."
)


def partitioned_over_ranks(module: nn.Module) -> bool:
    """True when ``module`` has ZeRO-3 partitioned parameters and runs in a process group of several ranks."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    if torch.distributed.get_world_size() < 2:
        return False
    return any(hasattr(p, "ds_id") for p in module.parameters())


#: > 0 inside :func:`forward_without_collectives`: forward passes of partitioned models make no collective
_collective_free = 0


@contextlib.contextmanager
def forward_without_collectives() -> Iterator[None]:
    """Within the block, ZeRO-3 forward passes make no collective, for models whose parameters are held whole.

    DeepSpeed's parameter coordinator starts every forward pass (``reset_step``) by broadcasting the order in which the
    modules fetched their parameters, until it has recorded that order; ranks that run different numbers of forward
    passes cannot make those broadcasts. With every parameter gathered there is nothing to fetch or prefetch and the
    order does not matter, so ``reset_step`` does nothing inside. Afterwards every coordinator a forward pass reached
    drops its trace (a local change, no collective, so also safe when the block ends on one rank by an exception) and
    records it again in the next forward pass, on every rank alike.

    Generation inside needs no ``synced_gpus`` then (each rank generates on its own, so ranks that run different
    numbers of batches do not wait for each other in it), and :func:`gathered_for_generation` no gather.
    """
    global _collective_free
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator

    reached: list[Any] = []
    originals = {name: Coordinator.__dict__[name] for name in ("reset_step", "trace_prologue")}

    def note(coordinator: Any) -> None:
        if all(coordinator is not seen for seen in reached):
            reached.append(coordinator)

    def reset_step(self: Any) -> None:
        note(self)

    def trace_prologue(self: Any, sub_module: nn.Module) -> None:
        note(self)
        originals["trace_prologue"](self, sub_module)

    Coordinator.reset_step = reset_step
    Coordinator.trace_prologue = trace_prologue
    _collective_free += 1
    try:
        yield
    finally:
        _collective_free -= 1
        for name, original in originals.items():
            setattr(Coordinator, name, original)
        for coordinator in reached:
            if not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()


def _takes_synced_gpus(method: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return "synced_gpus" in parameters


def _in_step(module: nn.Module, generate: Callable[..., Any]) -> Callable[..., Any]:
    """``generate`` with ``synced_gpus=True`` while ``module`` is partitioned over ranks (``False`` when not given
    while its forward passes make no collective), bound to ``module`` as a method (Fabric's
    ``mark_forward_method("generate")`` accepts only methods)."""

    @functools.wraps(generate)
    def generate_in_step(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if partitioned_over_ranks(self):
            if runs_without_collectives(self):
                if kwargs.get("synced_gpus") is None:  # forward passes make no collective: no need to stay in step
                    kwargs["synced_gpus"] = False
            elif kwargs.get("synced_gpus") is False:
                raise ValueError(SYNCED_GPUS_FALSE_ERROR.format(world=torch.distributed.get_world_size()))
            else:
                kwargs["synced_gpus"] = True
        return generate(*args, **kwargs)

    generate_in_step.__lightspeed_in_step__ = True  # type: ignore[attr-defined]
    return types.MethodType(generate_in_step, module)


def keep_generation_in_step(model: nn.Module) -> list[str]:
    """Make every ``generate`` method of ``model``'s modules that takes ``synced_gpus`` (HuggingFace's) pass
    ``synced_gpus=True`` while the module is partitioned over several ranks; returns the names of the modules changed
    (``""`` for ``model`` itself). Idempotent; a module that is no longer partitioned generates as before."""
    changed = []
    for name, module in model.named_modules():
        generate = getattr(module, "generate", None)
        if not callable(generate) or getattr(generate, "__lightspeed_in_step__", False):
            continue
        if not _takes_synced_gpus(generate):
            continue
        module.generate = _in_step(module, generate)
        changed.append(name)
    return changed


#: an id no DeepSpeed module has, held in every parameter's active-module set while gathered for generation, so that
#: DeepSpeed's post-forward release (which waits for that set to be empty) leaves the parameter whole
_GENERATION_HOLD = -20_251_125

#: the share of free memory the whole model may take for ``enabled="auto"`` to gather it
GATHER_MEMORY_SHARE = 0.5


def _fits_whole(params: list[torch.nn.Parameter], device: torch.device) -> bool:
    """Whether the whole model takes at most :data:`GATHER_MEMORY_SHARE` of this rank's free memory, agreed over all
    ranks (a collective: every rank answers the same)."""
    whole = sum(p.ds_numel * p.element_size() for p in params)  # type: ignore[attr-defined]
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        free = psutil.virtual_memory().available // max(1, local_ranks)
    verdicts: list[bool | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(verdicts, whole <= GATHER_MEMORY_SHARE * free)  # any backend, any device
    return all(verdicts)


def runs_without_collectives(module: nn.Module) -> bool:
    """Whether ``module``'s forward passes make no collective: inside :func:`forward_without_collectives`, with every
    ZeRO-3 parameter held whole by a gathered block."""
    return bool(_collective_free) and all(
        _GENERATION_HOLD in p.ds_active_sub_modules  # type: ignore[attr-defined]
        for p in module.parameters()
        if hasattr(p, "ds_id")
    )


@contextlib.contextmanager
def gathered_for_generation(model: nn.Module, enabled: bool | str = "auto") -> Iterator[bool]:
    """Within the block, ``model``'s ZeRO-3 parameters are gathered once and stay whole, so generation does not gather
    them again for every token (a collective: every rank enters it). Yields whether it gathered: ``enabled="auto"``
    gathers when the whole model takes at most half of every rank's free memory, ``True`` always, ``False`` never; a
    model that is not partitioned over several ranks is left as it is. Inside, the model runs without DeepSpeed's
    per-module hooks and its forward passes make no collective, so each rank generates at the speed of one plain
    process, without ``synced_gpus`` (ranks that stop at different steps do not wait for each other); forward passes
    with gradients are refused there (:data:`GRAD_INSIDE_GATHERED_ERROR`). Inside
    :func:`forward_without_collectives` (an evaluation with different batch counts per rank, model already whole) it
    yields True at once, without a collective.

    Args:
        model: the model (or the engine/module holding it) that generates inside the block.
        enabled: ``"auto"``, ``True`` (always gather) or ``False`` (never).
    """
    if enabled not in (True, False, "auto"):
        raise ValueError(f'gathered_for_generation(enabled=...) takes True, False or "auto"; got {enabled!r}.')
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not enabled or not partitioned_over_ranks(model):
        yield False
        return
    if runs_without_collectives(model):
        yield True  # inside gathered_for_evaluation: already whole, and gathering again would be a collective
        return
    # DeepSpeed gathers onto the compute device, also for parameters offloaded to the CPU
    on_cuda = torch.cuda.is_available() and torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    if enabled == "auto" and not _fits_whole(params, device):
        yield False
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        for param in params:
            param.ds_active_sub_modules.add(_GENERATION_HOLD)  # type: ignore[attr-defined]
        try:
            with forward_without_collectives(), _without_zero_hooks(model):
                yield True
        finally:
            for param in params:
                param.ds_active_sub_modules.discard(_GENERATION_HOLD)  # type: ignore[attr-defined]


GRAD_INSIDE_GATHERED_ERROR = (
    "A forward pass with gradients enabled inside lightspeed.gathered_for_generation (or a gathered evaluation): the "
    "model runs there without ZeRO-3's hooks, which a backward pass needs. Run training steps outside the block, and "
    "forward passes inside it under torch.no_grad() (generate does)."
)


def _is_zero_hook(hook: Any) -> bool:
    """A module hook DeepSpeed's ZeRO-3 registered (fetch before and release after every module's forward, the
    backward set-up, the start-of-forward step reset), by the module that defines it, looking through the wrappers
    DeepSpeed puts around some (its NVTX ranges: a closure over the one function it wraps)."""
    for _ in range(4):
        if str(getattr(hook, "__module__", "")).startswith("deepspeed.runtime.zero."):
            return True
        inner = getattr(hook, "__wrapped__", None)
        if inner is None:
            cells = [cell.cell_contents for cell in getattr(hook, "__closure__", None) or ()]
            functions = [value for value in cells if inspect.isfunction(value)]
            inner = functions[0] if len(functions) == 1 else None
        if inner is None:
            return False
        hook = inner
    return False


def _refuse_gradients(module: nn.Module, args: Any) -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(GRAD_INSIDE_GATHERED_ERROR)


@contextlib.contextmanager
def _without_zero_hooks(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s modules run without DeepSpeed's ZeRO-3 hooks: with every parameter gathered they
    only add Python work to every module's forward (the bulk of a generated token's time on a small model). They are
    put back afterwards in their places, hooks added meanwhile after them. Forward passes with gradients enabled are
    refused inside (a backward pass needs the hooks)."""
    saved: list[tuple[dict[int, Any], dict[int, Any]]] = []
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            if any(_is_zero_hook(hook) for hook in hooks.values()):
                saved.append((hooks, dict(hooks)))
                for key in [key for key, hook in hooks.items() if _is_zero_hook(hook)]:
                    del hooks[key]
    # on the modules holding parameters: a wrapper's own forward (Fabric's, DeepSpeed's engine) may still run with
    # gradients enabled before generate turns them off
    guards = [
        module.register_forward_pre_hook(_refuse_gradients)
        for module in model.modules()
        if any(param is not None for param in module._parameters.values())
    ]
    try:
        yield
    finally:
        for guard in guards:
            guard.remove()
        for hooks, before in saved:
            added = {key: hook for key, hook in hooks.items() if key not in before}
            hooks.clear()
            hooks.update(before)
            hooks.update(added)
