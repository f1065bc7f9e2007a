"""The keyword arguments of the ZeRO strategies: their names read from the signatures (never a hand-kept list), and
the error for a keyword a strategy does not take, with what to do instead. Most such keywords come from Lightning's
own ``DeepSpeedStrategy`` (users migrating) or from the other front end's strategy."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, get_args, get_origin

from typing_extensions import Unpack

__all__ = [
    "named_arguments",
    "refuse_unknown_keywords",
    "unknown_keywords_error",
    "unpacked_keywords",
    "unpacked_typed_dict",
]

_CONFIG_HINT = "write it into the DeepSpeed config instead: {cls}(config={{...}})"
#: Lightning DeepSpeedStrategy keywords that neither front end takes, with what to do instead
_LIGHTNING_KEYWORDS: dict[str, str] = {
    "zero_optimization": "pick the stage with the strategy name (zero1 ... zero3) or `stage=`",
    "remote_device": "offload parameters with `offload_parameters='cpu'` or `'nvme'`",
    "offload_params_device": "use `offload_parameters='cpu'` or `offload_parameters='nvme'`",
    "offload_optimizer_device": "use `offload_optimizer='cpu'` or `offload_optimizer='nvme'`",
    "logging_batch_size_per_gpu": "set `train_micro_batch_size_per_gpu` in the DeepSpeed config",
    "stage3_prefetch_bucket_size": "use `prefetch_bucket_size=`",
    "stage3_param_persistence_threshold": "use `param_persistence_threshold=`",
}
#: keywords of the other front end's strategy, with what to do instead
_FRONT_END_KEYWORDS: dict[str, dict[str, str]] = {
    "Fabric": {
        "sync_with_dataloader": "it is how the Trainer's loop ends an epoch; in a Fabric loop use "
        "`lightspeed.fabric.accumulate(fabric, model, loader, steps=N)`, which steps the short last window of an "
        "epoch with its gradient scaled to its real size",
        "precision_plugin": "pass the precision to Fabric: Fabric(precision='bf16-mixed')",
        "start_method": "Fabric starts its processes itself (`fabric.launch()`)",
        "models": "set each model up with its own `fabric.setup(model, optimizer)`; "
        "`lightspeed.fabric.model_options(model, stage=...)` gives one its own options",
    },
    "Trainer": {
        "precision": "pass the precision to the Trainer: Trainer(precision='bf16-mixed')",
    },
}
#: Lightning DeepSpeedStrategy keywords that are DeepSpeed config entries
_CONFIG_KEYWORDS = (
    "params_buffer_count",
    "params_buffer_size",
    "max_in_cpu",
    "optimizer_buffer_count",
    "block_size",
    "queue_depth",
    "single_submit",
    "overlap_events",
    "thread_count",
    "contiguous_gradients",
    "overlap_comm",
    "allgather_partitions",
    "reduce_scatter",
    "zero_allow_untested_optimizer",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
)


def unknown_keywords_error(
    cls_name: str, keywords: Mapping[str, Any], takes: Sequence[str], front_end: str
) -> TypeError:
    """The error for keywords a ZeRO strategy of ``front_end`` (``"Trainer"`` or ``"Fabric"``) does not take, each with
    what to do instead, listing the keywords it ``takes``."""
    hints = {**_LIGHTNING_KEYWORDS, **_FRONT_END_KEYWORDS.get(front_end, {})}
    lines = []
    for name in sorted(keywords):
        if name in hints:
            lines.append(f"`{name}`: {hints[name]}")
        elif name in _CONFIG_KEYWORDS:
            lines.append(f"`{name}`: {_CONFIG_HINT.format(cls=cls_name)}")
        else:
            lines.append(f"`{name}`: not a keyword of {cls_name}")
    return TypeError(
        f"{cls_name} does not take "
        + ", ".join(f"`{name}`" for name in sorted(keywords))
        + ".\n  - "
        + "\n  - ".join(lines)
        + f"\n{cls_name} takes: {', '.join(takes)}."
    )


def refuse_unknown_keywords(
    cls_name: str, keywords: Mapping[str, Any], strategy: type, front_end: str, decided: frozenset[str] = frozenset()
) -> None:
    """Raise :func:`unknown_keywords_error` for the ``keywords`` that ``strategy`` does not take by name (or that the
    caller ``decided`` itself), naming ``cls_name``, the class the user called."""
    if not keywords:  # the usual case: nothing to read the signature for
        return
    takes = named_arguments(strategy)
    unknown = {name: value for name, value in keywords.items() if name not in takes or name in decided}
    if unknown:
        raise unknown_keywords_error(cls_name, unknown, takes, front_end)


def named_arguments(cls: type) -> list[str]:
    """The keyword arguments ``cls(...)`` declares by name, in order, those of a ``**arguments: Unpack[SomeTypedDict]``
    too (from its signature: never a hand-kept list)."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names: list[str] = []
    for name, parameter in inspect.signature(cls).parameters.items():
        if parameter.kind in named:
            names.append(name)
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            names += unpacked_keywords(cls.__init__, name)  # type: ignore[misc]
    return names


def unpacked_keywords(function: Callable[..., Any], name: str) -> list[str]:
    """The keys of the typed dict that ``function``'s ``**name`` is annotated to unpack (PEP 692); none otherwise."""
    typed_dict = unpacked_typed_dict(function, name)
    return [] if typed_dict is None else list(typed_dict.__annotations__)


def unpacked_typed_dict(function: Callable[..., Any], name: str) -> type | None:
    """The typed dict of ``function``'s ``**name: Unpack[...]`` (PEP 692), else None."""
    annotation = function.__annotations__.get(name)
    if isinstance(annotation, str):  # postponed (``from __future__ import annotations``): the one name to evaluate
        annotation = eval(annotation, function.__globals__)  # noqa: S307  # a module's own annotation, not input
    if get_origin(annotation) is not Unpack:
        return None
    typed_dict: type = get_args(annotation)[0]
    return typed_dict
