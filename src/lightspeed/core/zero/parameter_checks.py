"""Parameters a ZeRO engine cannot train the way one plain process does, refused before anything is cast or built.

* float64: Lightning's DeepSpeed precision plugin casts the module to float32 under ``"32-true"`` and DeepSpeed casts
  it to bf16/fp16 under mixed precision, so a float64 parameter would silently train in another precision;
* 0-dimensional (a scalar such as CLIP's ``logit_scale``): DeepSpeed's first broadcast views every parameter as
  bytes, which a 0-dim tensor cannot be, and fails with a message that names neither the parameter nor a remedy;
* param groups split by shape over ZeRO-3 partitions (nanoGPT's ``p.dim() >= 2`` weight-decay split in
  ``configure_optimizers`` for a model built in ``configure_model``): a partition is flat, so every parameter lands
  in the no-decay group and the decay group stays empty, silently.

And, for evaluation that reuses the training engine, parameters that are no longer the ones it trained
(:func:`check_same_parameters`).
"""

from __future__ import annotations

import torch
from torch import nn

from lightspeed.core.errors import DeepSpeedConfigError, ModelChangedError

__all__ = [
    "check_parameters_for_zero",
    "check_partitions_kept",
    "check_same_parameters",
    "check_shape_split_groups",
    "parameter_ids",
]


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"'{name}'" for name in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_parameters_for_zero(module: nn.Module) -> None:
    """Raise one :class:`DeepSpeedConfigError` naming every float64 or 0-dimensional parameter of ``module`` (a
    ZeRO-3 partitioned parameter is judged by its full shape) and what to change."""
    problems = []
    wide = [name for name, param in module.named_parameters() if param.dtype == torch.float64]
    if wide:
        they, them = ("it", "it") if len(wide) == 1 else ("they", "them")
        problems.append(
            f"{_listed(wide)} {'is' if len(wide) == 1 else 'are'} float64, but ZeRO trains float32 parameters (with "
            f"bf16/fp16 copies under mixed precision): {they} would be cast without a word and train unlike one "
            f"process. Make {them} float32 in the model (`.float()`), or train the model with a strategy that keeps "
            "float64 (ddp)."
        )
    scalars = [name for name, param in module.named_parameters() if len(getattr(param, "ds_shape", param.shape)) == 0]
    if scalars:
        what = "is a 0-dimensional parameter" if len(scalars) == 1 else "are 0-dimensional parameters"
        problems.append(
            f"{_listed(scalars)} {what}, which DeepSpeed cannot broadcast (it fails with 'self.dim() cannot be 0 to "
            "view Float as Byte'). Give each one element: `nn.Parameter(torch.tensor([2.0]))` instead of "
            "`torch.tensor(2.0)` (it broadcasts the same in arithmetic)."
        )
    if problems:
        raise DeepSpeedConfigError(
            "The model has parameters ZeRO cannot train as one process does: " + " ".join(problems)
        )


def check_shape_split_groups(optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    """Raise a :class:`DeepSpeedConfigError` when ``optimizer`` has a param group with weight decay but no parameters
    while ZeRO-3 partitions of two or more dimensions sit in groups without weight decay: the mark of a split by
    ``p.dim()``/``p.shape``, which see the flat partition, not the parameter."""
    groups = optimizer.param_groups
    empty = [index for index, group in enumerate(groups) if not group["params"] and group.get("weight_decay", 0)]
    if not empty:
        return
    names = {id(param): name for name, param in module.named_parameters()}
    undecayed = [
        names.get(id(param), "?")
        for group in groups
        if not group.get("weight_decay", 0)
        for param in group["params"]
        if len(getattr(param, "ds_shape", ())) >= 2
    ]
    if undecayed:
        raise DeepSpeedConfigError(
            f"Param group {empty[0]} of {type(optimizer).__name__} has weight_decay={groups[empty[0]]['weight_decay']} "
            f"but no parameters, while {len(undecayed)} parameter(s) of two or more dimensions ({_listed(undecayed)}) "
            "are in groups without weight decay. The model was built as ZeRO-3 partitions (in `configure_model` or "
            "under `fabric.init_module()`), so `p.dim()` and `p.shape` see a flat partition, not the parameter: split "
            "by the full shape, `len(getattr(p, 'ds_shape', p.shape)) >= 2`, or by name."
        )


def check_partitions_kept(module: nn.Module, built_under: str, instead: str) -> None:
    """Raise a :class:`DeepSpeedConfigError` when parameters of ``module`` built as ZeRO-3 partitions lost their
    partition (call it only for a model built under ``built_under``: ``configure_model`` or
    ``fabric.init_module()``): deep copies made there are partitioned (:mod:`lightspeed.core.zero.partitioned_build`),
    but a parameter copied another way (pickled and loaded, ``copy.copy``) or whose ``.data`` was replaced keeps an
    empty tensor DeepSpeed knows nothing of, and the first forward would fail deep inside DeepSpeed. ``instead``:
    where to build the model so that ZeRO-3 partitions it itself."""
    lost = [name for name, param in module.named_parameters() if not hasattr(param, "ds_id") and param.numel() == 0]
    if lost:
        shown = ", ".join(lost[:3]) + (f" and {len(lost) - 3} more" if len(lost) > 3 else "")
        raise DeepSpeedConfigError(
            f"Parameters {shown} were built under {built_under} with ZeRO-3 but lost their partition: they are empty "
            "tensors DeepSpeed knows nothing of, left by a partitioned parameter copied other than with "
            "`copy.deepcopy` (pickled, `copy.copy`) or by a `.data` replaced. Build the model "
            f"{instead} (ZeRO-3 then partitions it when the engine is built), or create or deep-copy those layers "
            "instead."
        )


def parameter_ids(module: nn.Module) -> tuple[int, ...]:
    """The identities of ``module``'s parameters, in order (what :func:`check_same_parameters` compares)."""
    return tuple(id(param) for param in module.parameters())


def check_same_parameters(trained: tuple[int, ...], module: nn.Module, stage: str) -> None:
    """Raise :class:`ModelChangedError` when ``module`` no longer holds the parameters the training engine was built
    with (``trained``, from :func:`parameter_ids`): ``stage`` (validate, test, predict) would run new ones, never
    trained, through an engine that does not know them."""
    if parameter_ids(module) == trained:
        return
    raise ModelChangedError(
        f"{type(module).__name__} holds other parameters than the ones fit trained, so {stage} would not evaluate "
        "the trained weights. Lightning calls configure_model again for every stage: return early when the model "
        "already exists (`if getattr(self, 'model', None) is not None: return`)."
    )
