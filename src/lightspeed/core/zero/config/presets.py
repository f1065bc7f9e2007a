"""The base DeepSpeed config behind each of our ZeRO strategies."""

from __future__ import annotations

from typing import Any

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config.choices import AUTO, OFFLOAD_TARGETS, check_zero_stage


def _checked_size(name: str, value: int | float | str, zero_allowed: bool = False) -> int | str:
    """'auto' or a positive element count (``zero_allowed``: 0 too); whole floats such as 5e8 are accepted (and made
    ints) as DeepSpeed does."""
    if value == AUTO:
        return AUTO
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero_allowed else 1):
        kind = "a whole number of elements >= 0" if zero_allowed else "a positive whole number of elements"
        raise DeepSpeedConfigError(f"{name} must be {kind} or 'auto', got {value!r}.")
    return value


def _offload(target: str, nvme_path: str | None, pin_memory: bool) -> dict[str, Any]:
    section: dict[str, Any] = {"device": target, "pin_memory": pin_memory}
    if target == "nvme":
        section["nvme_path"] = nvme_path
    return section


def zero_preset(
    stage: int,
    offload_optimizer: str = "none",
    offload_parameters: str = "none",
    nvme_path: str | None = None,
    pin_memory: bool = True,
    reduce_bucket_size: int | str = AUTO,
    allgather_bucket_size: int | str = AUTO,
    prefetch_bucket_size: int | str = AUTO,
    param_persistence_threshold: int | str = AUTO,
    sub_group_size: int | None = None,
) -> dict:
    """The base DeepSpeed config for ZeRO ``stage`` with the given offload targets ("none", "cpu" or "nvme").

    Everything the Trainer decides (micro batch size, accumulation, clipping, precision) is "auto", and so are the
    bucket sizes, which :func:`resolve_config` derives from the model's hidden size. Stages 2 and 3 overlap the
    gradient reduction with the backward pass into contiguous buffers, as DeepSpeed's ZeRO tutorial configures
    them; stage 1 keeps DeepSpeed's defaults there. ``zero_allow_untested_optimizer`` is on so any torch
    optimizer from the LightningModule can be used.
    """
    check_zero_stage(stage)
    for name, target in (("offload_optimizer", offload_optimizer), ("offload_parameters", offload_parameters)):
        if target not in OFFLOAD_TARGETS:
            raise DeepSpeedConfigError(f"{name} must be 'none', 'cpu' or 'nvme', got {target!r}.")
    if offload_optimizer != "none" and stage == 0:
        raise DeepSpeedConfigError(
            "Optimizer offload needs ZeRO stage 1, 2 or 3, but stage is 0. Use stage>=1 or offload_optimizer='none'."
        )
    if offload_parameters != "none" and stage != 3:
        raise DeepSpeedConfigError(
            f"Parameter offload needs ZeRO stage 3, but stage is {stage}. Use stage 3 or offload_parameters='none'."
        )
    uses_nvme = "nvme" in (offload_optimizer, offload_parameters)
    if uses_nvme and not nvme_path:
        raise DeepSpeedConfigError(
            "Offloading to 'nvme' needs nvme_path: pass the directory on the NVMe drive to swap into, e.g. "
            "nvme_path='/local_nvme'."
        )
    if nvme_path and not uses_nvme:
        raise DeepSpeedConfigError(
            f"nvme_path={nvme_path!r} is only used when offloading to 'nvme'. Set offload_optimizer='nvme' and/or "
            "offload_parameters='nvme', or drop nvme_path."
        )
    reduce_bucket_size = _checked_size("reduce_bucket_size", reduce_bucket_size)
    allgather_bucket_size = _checked_size("allgather_bucket_size", allgather_bucket_size)
    prefetch_bucket_size = _checked_size("prefetch_bucket_size", prefetch_bucket_size)
    # 0 is DeepSpeed's "partition every parameter, however small"
    param_persistence_threshold = _checked_size(
        "param_persistence_threshold", param_persistence_threshold, zero_allowed=True
    )
    if sub_group_size == AUTO:
        sub_group_size = None  # nothing to derive it from: DeepSpeed's default
    if sub_group_size is not None:
        sub_group_size = _checked_size("sub_group_size", sub_group_size)  # type: ignore[assignment]
    if stage != 3:
        for name, value in (
            ("prefetch_bucket_size", prefetch_bucket_size),
            ("param_persistence_threshold", param_persistence_threshold),
            ("sub_group_size", sub_group_size),
        ):
            if value not in (AUTO, None):
                raise DeepSpeedConfigError(f"{name} only applies to ZeRO stage 3, but stage is {stage}. Drop it.")
    if stage == 3 and allgather_bucket_size != AUTO:
        raise DeepSpeedConfigError(
            "allgather_bucket_size only applies to ZeRO stages 1 and 2; stage 3 gathers parameters in "
            "prefetch_bucket_size chunks. Set prefetch_bucket_size instead."
        )

    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero["reduce_bucket_size"] = reduce_bucket_size
    if stage in (1, 2):
        zero.update(
            {"allgather_partitions": True, "reduce_scatter": True, "allgather_bucket_size": allgather_bucket_size}
        )
    if stage == 1:
        # gradients are reduced once, at the accumulation boundary, so there is nothing to overlap; without
        # DeepSpeed's gradient hooks (contiguous_gradients) they are reduced parameter by parameter in a fixed order,
        # so ranks that used different parameters still reduce the same list (see core/zero/unused_parameters.py)
        zero["contiguous_gradients"] = False
    if stage >= 2:
        zero.update({"overlap_comm": True, "contiguous_gradients": True})
    if stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": prefetch_bucket_size,
                "stage3_param_persistence_threshold": param_persistence_threshold,
            }
        )
        if sub_group_size is not None:
            zero["sub_group_size"] = sub_group_size
    if offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(offload_optimizer, nvme_path, pin_memory)
    if offload_parameters != "none":
        zero["offload_param"] = _offload(offload_parameters, nvme_path, pin_memory)

    return {
        "train_micro_batch_size_per_gpu": AUTO,
        "gradient_accumulation_steps": AUTO,
        "gradient_clipping": AUTO,
        "fp16": {"enabled": AUTO},
        "bf16": {"enabled": AUTO},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
    }
