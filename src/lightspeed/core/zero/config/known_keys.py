"""Which keys DeepSpeed reads, at every nesting level we can know, taken from DeepSpeed itself.

Sections that DeepSpeed parses with pydantic models (``zero_optimization``, ``fp16``, ``bf16``, the monitors,
...) contribute their field names *and* aliases, recursively for nested models. Sections that DeepSpeed reads as
plain dicts contribute the string constants DeepSpeed looks them up with. Only keys DeepSpeed reads without any
constant are listed by hand below, each with a comment saying where DeepSpeed reads it.

A constant or model missing from the installed DeepSpeed simply means that version does not read that key, so it
is skipped rather than failing: the key sets always describe the DeepSpeed that will actually run.
"""

from __future__ import annotations

import functools
import importlib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Section:
    """The keys DeepSpeed knows inside one JSON object of the config.

    ``children`` maps keys whose value is itself an object with known keys to that object's ``Section``; other
    known keys hold scalars or free-form objects (e.g. ``optimizer.params``, passed on to the optimizer).
    ``strict`` says whether DeepSpeed itself rejects unknown keys here (pydantic ``extra="forbid"``) or silently
    ignores them (plain dict lookups).
    """

    keys: frozenset[str]
    children: Mapping[str, Section] = field(default_factory=dict)
    strict: bool = False
    # Keys DeepSpeed used to read and now refuses, with DeepSpeed's own explanation.
    removed: Mapping[str, str] = field(default_factory=dict)


def _module(path: str) -> types.ModuleType | None:
    """The DeepSpeed module at ``path``, or None when this DeepSpeed version has no such module. Any other import
    failure propagates: an empty key set would report every key of the user's config as unknown."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as err:
        if err.name is not None and path.startswith(err.name) and err.name.startswith("deepspeed."):
            return None
        raise


def _consts(module_path: str, *names: str) -> set[str]:
    """The values of the named string constants in a DeepSpeed module (missing ones skipped)."""
    module = _module(module_path)
    if module is None:
        return set()
    values = (getattr(module, name, None) for name in names)
    return {value for value in values if isinstance(value, str)}


def deepspeed_attr(module_path: str, name: str) -> Any:
    module = _module(module_path)
    return None if module is None else getattr(module, name, None)


def _pydantic_model_in(annotation: Any) -> type | None:
    """The pydantic model class inside an annotation such as ``Optional[Model]``, if there is one."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _pydantic_model_in(arg)
        if found is not None:
            return found
    return None


def _field_names(name: str, info: Any) -> set[str]:
    names = {name}
    if isinstance(info.alias, str):
        names.add(info.alias)
    validation_alias = getattr(info, "validation_alias", None)
    if isinstance(validation_alias, str):
        names.add(validation_alias)
    for choice in getattr(validation_alias, "choices", ()) or ():
        if isinstance(choice, str):
            names.add(choice)
    return names


def section_from_model(model: Any) -> Section:
    """Field names and aliases of a DeepSpeed pydantic config model, recursing into nested models."""
    if model is None:
        return Section(frozenset())
    keys: set[str] = set()
    children: dict[str, Section] = {}
    for name, info in model.model_fields.items():
        names = _field_names(name, info)
        keys |= names
        nested = _pydantic_model_in(info.annotation)
        if nested is not None and nested is not model:
            nested_section = section_from_model(nested)
            for alias in names:
                children[alias] = nested_section
    strict = getattr(model, "model_config", {}).get("extra") == "forbid"
    return Section(frozenset(keys), children, strict)


def _plain(keys: set[str], children: Mapping[str, Section] | None = None) -> Section:
    return Section(frozenset(keys), dict(children or {}), strict=False)


# Keys DeepSpeed reads without a named constant. Each entry says where it is read.
_TOP_LEVEL_WITHOUT_CONSTANT = {
    "pipeline",  # runtime/config.py get_pipeline_config: param_dict.get("pipeline", {})
    "hybrid_engine",  # runtime/config.py get_hybrid_engine_config
    "weight_quantization",  # runtime/config.py DeepSpeedConfig._initialize_params
    "compile",  # runtime/config.py: CompileConfig(**param_dict.get('compile', {}))
    "tensor_parallel",  # runtime/tensor_parallel/config.py get_tensor_parallel_config
    "sequence_parallel_size",  # deepspeed/__init__.py initialize() and DeepSpeedConfig world size
    "data_parallel_size",  # deepspeed/__init__.py initialize(): mesh with sequence_parallel_size
}
_OPTIMIZER_WRAPPER_WITHOUT_CONSTANT: set[str] = set()


@functools.lru_cache(maxsize=1)
def top_level_section() -> Section:
    """The whole known-key tree of a DeepSpeed config, built once from the installed DeepSpeed."""
    rc = "deepspeed.runtime.constants"
    top = _consts(
        rc,
        "TRAIN_BATCH_SIZE",
        "TRAIN_MICRO_BATCH_SIZE_PER_GPU",
        "GRADIENT_ACCUMULATION_STEPS",
        "MANAGED_GRADIENT_ACCUMULATION",
        "OPTIMIZER",
        "SCHEDULER",
        "ZERO_ALLOW_UNTESTED_OPTIMIZER",
        "ZERO_FORCE_DS_CPU_OPTIMIZER",
        "STEPS_PER_PRINT",
        "BFLOAT16",
        "BFLOAT16_OLD",
        "FP16",
        "TORCH_AUTOCAST",
        "GRADIENT_CLIPPING",
        "COMMUNICATION_DATA_TYPE",
        "SEQ_PARALLEL_COMMUNICATION_DATA_TYPE",
        "PRESCALE_GRADIENTS",
        "GRADIENT_PREDIVIDE_FACTOR",
        "GRADIENT_ALLREDUCE_OP",
        "DISABLE_ALLGATHER",
        "DUMP_STATE",
        "DISABLE_PYTHON_GC",
        "VOCABULARY_SIZE",
        "WALL_CLOCK_BREAKDOWN",
        "MEMORY_BREAKDOWN",
        "CHECKPOINT",
        "DATA_TYPES",
        "DATALOADER_DROP_LAST",
        "USE_DATA_BEFORE_EXPERT_PARALLEL",
        "LOG_LEVEL",
    )
    top |= _consts("deepspeed.runtime.zero.config", "ZERO_OPTIMIZATION")
    top |= _consts("deepspeed.runtime.activation_checkpointing.config", "ACT_CHKPT")
    top |= _consts("deepspeed.comm.constants", "COMMS_LOGGER")
    top |= _consts("deepspeed.profiling.constants", "FLOPS_PROFILER")
    top |= _consts("deepspeed.autotuning.constants", "AUTOTUNING")
    top |= _consts("deepspeed.runtime.data_pipeline.constants", "DATA_EFFICIENCY")
    top |= _consts("deepspeed.runtime.swap_tensor.constants", "AIO")
    top |= _consts("deepspeed.datastates.config", "DATASTATES_CHECKPOINTING")
    top |= _consts("deepspeed.utils.config", "TIMERS")
    top |= _consts("deepspeed.runtime.config", "EXPERT_PARALLEL")
    top |= _TOP_LEVEL_WITHOUT_CONSTANT

    children: dict[str, Section] = {}

    zero_model = deepspeed_attr("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig")
    zero = section_from_model(zero_model)
    removed_zero = deepspeed_attr("deepspeed.runtime.config", "_REMOVED_ZERO_CONFIG_KEYS") or {}
    children["zero_optimization"] = Section(zero.keys, zero.children, zero.strict, dict(removed_zero))

    fp16 = section_from_model(deepspeed_attr("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"))
    bf16 = section_from_model(deepspeed_attr("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"))
    children["fp16"] = fp16
    children["bf16"] = bf16
    children["bfloat16"] = bf16  # DeepSpeed's backward-compatible name for the bf16 section

    # optimizer / scheduler: DeepSpeed reads "type" and "params" (and "legacy_fusion"); "params" is handed to the
    # optimizer or scheduler constructor, so its keys depend on the type and are not checked here.
    optimizer_keys = _consts(rc, "TYPE", "OPTIMIZER_PARAMS", "LEGACY_FUSION") | _OPTIMIZER_WRAPPER_WITHOUT_CONSTANT
    children["optimizer"] = _plain(optimizer_keys)
    children["scheduler"] = _plain(_consts(rc, "TYPE", "SCHEDULER_PARAMS"))

    children["activation_checkpointing"] = _plain(
        _consts(
            "deepspeed.runtime.activation_checkpointing.config",
            "ACT_CHKPT_PARTITION_ACTIVATIONS",
            "ACT_CHKPT_NUMBER_CHECKPOINTS",
            "ACT_CHKPT_CONTIGUOUS_MEMORY_OPTIMIZATION",
            "ACT_CHKPT_SYNCHRONIZE_CHECKPOINT_BOUNDARY",
            "ACT_CHKPT_PROFILE",
            "ACT_CHKPT_CPU_CHECKPOINTING",
        )
    )
    children["aio"] = _plain(
        _consts(
            "deepspeed.runtime.swap_tensor.constants",
            "AIO_BLOCK_SIZE",
            "AIO_QUEUE_DEPTH",
            "AIO_INTRA_OP_PARALLELISM",
            "AIO_THREAD_COUNT",  # older DeepSpeed name of intra_op_parallelism
            "AIO_SINGLE_SUBMIT",
            "AIO_OVERLAP_EVENTS",
            "AIO_USE_GDS",
        )
    )
    children["flops_profiler"] = _plain(
        _consts(
            "deepspeed.profiling.constants",
            "FLOPS_PROFILER_ENABLED",
            "FLOPS_PROFILER_RECOMPUTE_FWD_FACTOR",
            "FLOPS_PROFILER_PROFILE_STEP",
            "FLOPS_PROFILER_MODULE_DEPTH",
            "FLOPS_PROFILER_TOP_MODULES",
            "FLOPS_PROFILER_DETAILED",
            "FLOPS_PROFILER_OUTPUT_FILE",
        )
    )
    mc = "deepspeed.runtime.model_checkpointing.constants"
    writer = _plain(
        _consts(
            mc,
            "CHECKPOINT_WRITER_TYPE",
            "CHECKPOINT_IO_BUFFER_SIZE",
            "CHECKPOINT_IO_BUFFER_DOUBLE",
            "CHECKPOINT_IO_STATISTICS",
            "CHECKPOINT_DATA_PARALLEL",
            "CHECKPOINT_WRITER_DECOUPLED",
            "CHECKPOINT_IO_MULTIPLIER",
        )
    )
    checkpoint_keys = _consts(
        mc, "CHECKPOINT_TAG_VALIDATION", "CHECKPOINT_SERIALIZATION", "CHECKPOINT_WRITER"
    ) | _consts(
        rc,
        "CHECKPOINT_TAG_VALIDATION",
        "LOAD_UNIVERSAL_CHECKPOINT",
        "USE_NODE_LOCAL_STORAGE_CHECKPOINT",
        "CHECKPOINT_PARALLEL_WRITE",
    )
    checkpoint_children = {}
    if writer.keys:
        checkpoint_children[next(iter(_consts(mc, "CHECKPOINT_WRITER")))] = writer
    parallel_write = _consts(rc, "CHECKPOINT_PARALLEL_WRITE")
    if parallel_write:
        checkpoint_children[next(iter(parallel_write))] = _plain(
            _consts(rc, "CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE")
        )
    children["checkpoint"] = _plain(checkpoint_keys, checkpoint_children)
    children["data_types"] = _plain(
        _consts(rc, "GRAD_ACCUM_DTYPE", "PARAM_DTYPE", "BUFFER_DTYPE", "KEEP_IN_FP32_MODULES")
    )
    children["torch_autocast"] = _plain(
        _consts(rc, "TORCH_AUTOCAST_ENABLED", "TORCH_AUTOCAST_DTYPE", "TORCH_AUTOCAST_LOWER_PRECISION_SAFE_MODULES")
    )

    comms = deepspeed_attr("deepspeed.comm.config", "CommsLoggerConfig")
    if comms is not None:
        children["comms_logger"] = section_from_model(comms)
    monitor = deepspeed_attr("deepspeed.monitor.config", "DeepSpeedMonitorConfig")
    if monitor is not None:
        # tensorboard / wandb / csv_monitor / comet are top-level sections, each its own pydantic model.
        monitor_section = section_from_model(monitor)
        top |= monitor_section.keys
        children.update(monitor_section.children)
    timer_model = deepspeed_attr("deepspeed.utils.config", "DeepSpeedThroughputTimerConfig")
    timers_throughput = _consts("deepspeed.utils.config", "TIMERS_THROUGHPUT")
    if timer_model is not None and timers_throughput:
        children["timers"] = _plain(timers_throughput, {next(iter(timers_throughput)): section_from_model(timer_model)})
    for name, path, cls in (
        ("hybrid_engine", "deepspeed.runtime.config", "HybridEngineConfig"),
        ("weight_quantization", "deepspeed.inference.config", "WeightQuantConfig"),
        ("compile", "deepspeed.compile.config", "CompileConfig"),
        ("tensor_parallel", "deepspeed.runtime.tensor_parallel.config", "TPTrainingConfig"),
    ):
        model = deepspeed_attr(path, cls)
        if model is not None:
            children[name] = section_from_model(model)
    # Sections whose keys are not checked (free-form or too version-dependent to pin down): autotuning,
    # data_efficiency, pipeline, datastates_ckpt, expert_parallel. Their top-level names are still checked.

    removed_top = deepspeed_attr("deepspeed.runtime.config", "_REMOVED_TOP_LEVEL_CONFIG_KEYS") or {}
    return Section(frozenset(top), children, strict=False, removed=dict(removed_top))
