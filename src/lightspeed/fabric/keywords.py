"""The keyword arguments of the Fabric ZeRO strategies: their names read from the signatures (never a hand-kept
list), and the error for a keyword they do not take, with what to do instead (most come from Lightning Fabric's own
``DeepSpeedStrategy`` or from the Trainer's strategy)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

__all__ = ["SEVERAL_MODELS", "named_arguments", "unknown_keywords_error"]

#: how a Fabric loop trains several models, each with its own optimizer (for the one-optimizer error)
SEVERAL_MODELS = (
    "set each up with its own optimizer: `fabric.setup(generator, opt_g)`, `fabric.setup(discriminator, opt_d)`"
)

# Keywords of Lightning Fabric's own DeepSpeedStrategy (or of lightspeed's Trainer strategy) that this strategy does
# not take, with what to do instead.
_CONFIG_HINT = "write it into the DeepSpeed config instead: ZeroFabricStrategy(config={...})"
_REFUSED_KEYWORDS: dict[str, str] = {
    "sync_with_dataloader": "it is how the Trainer's loop ends an epoch; in a Fabric loop use "
    "`lightspeed.fabric.accumulate(fabric, model, loader, steps=N)`, which steps the short last window of an epoch "
    "with its gradient scaled to its real size",
    "precision_plugin": "pass the precision to Fabric: Fabric(precision='bf16-mixed')",
    "zero_optimization": "pick the stage with the strategy name (zero1 ... zero3) or `stage=`",
    "remote_device": "offload parameters with `offload_parameters='cpu'` or `'nvme'`",
    "offload_params_device": "use `offload_parameters='cpu'` or `offload_parameters='nvme'`",
    "offload_optimizer_device": "use `offload_optimizer='cpu'` or `offload_optimizer='nvme'`",
    "logging_batch_size_per_gpu": "set `train_micro_batch_size_per_gpu` in the DeepSpeed config",
}
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


def unknown_keywords_error(cls_name: str, keywords: dict[str, Any], takes: Sequence[str]) -> TypeError:
    """The error for keywords a Fabric ZeRO strategy does not take, each with what to do instead, listing the
    keywords it ``takes``."""
    lines = []
    for name in sorted(keywords):
        if name in _REFUSED_KEYWORDS:
            lines.append(f"`{name}`: {_REFUSED_KEYWORDS[name]}")
        elif name in _CONFIG_KEYWORDS:
            lines.append(f"`{name}`: {_CONFIG_HINT}")
        else:
            lines.append(f"`{name}`: not a keyword of {cls_name}")
    return TypeError(
        f"{cls_name} does not take "
        + ", ".join(f"`{name}`" for name in sorted(keywords))
        + ".\n  - "
        + "\n  - ".join(lines)
        + f"\n{cls_name} takes: {', '.join(takes)}."
    )


def named_arguments(cls: type) -> list[str]:
    """The keyword arguments ``cls(...)`` declares by name, in order (from its signature: never a hand-kept list)."""
    return [
        name
        for name, parameter in inspect.signature(cls).parameters.items()
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
