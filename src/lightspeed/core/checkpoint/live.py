"""Export a running DeepSpeed engine straight to safetensors, parameter by parameter.

Every rank walks the module's ``state_dict`` in the same order. For a trainable parameter all ranks assemble the
fp32 master copy (``deepspeed.utils.safe_get_full_fp32_param``, a collective); a frozen ZeRO-3 parameter is
gathered with ``GatheredParameters([param])``. Rank 0 writes each tensor as soon as it is assembled and drops it,
so no rank ever holds more than one full parameter. The result is bit-identical to exporting the checkpoint the
engine would save at this moment.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightspeed.core.checkpoint.exporter import ExportResult, write_export_files
from lightspeed.core.checkpoint.hf_config import HFConfigFiles, find_hf_config
from lightspeed.core.checkpoint.options import ExportOptions
from lightspeed.core.checkpoint.plan import (
    OutputTensor,
    output_dtype,
    safetensors_metadata,
    select_keys,
    wrapper_unwrapper,
)
from lightspeed.core.checkpoint.safetensors_writer import drain
from lightspeed.core.common.distributed import global_rank, is_distributed, raise_on_every_rank
from lightspeed.core.errors import ExportError
from lightspeed.core.peft.layout import AdapterLayout, adapter_layouts
from lightspeed.core.peft.merged import merged_tensors
from lightspeed.core.reliability.staging import check_output_dir_on_every_rank, staged_output

__all__ = ["export_engine"]


def _has_fp32_master(engine: Any) -> bool:
    stage = engine.zero_optimization_stage()
    return stage > 0 or bool(getattr(engine, "bfloat16_enabled", lambda: False)())


def _gathered(param: torch.Tensor) -> torch.Tensor:
    if hasattr(param, "ds_id"):  # ZeRO-3 partitioned parameter
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.detach().to("cpu", copy=True)
    return param.detach().to("cpu")


def _on_cpu(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.detach().to("cpu")


def _master(param: torch.Tensor) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param)
    if full is None:
        return _gathered(param)
    return full.detach().to("cpu").view(getattr(param, "ds_shape", param.shape))


def _agree_on_write(failure: BaseException | None, output_dir: str | os.PathLike) -> None:
    """Every rank raises when rank 0 could not write the export (a collective: every rank must call it, rank 0
    with its failure, the others with None): rank 0 raises its own error, the others an ExportError naming it."""
    report = None
    if failure is not None:
        report = ExportError(f"rank 0 could not write the export to {output_dir} ({type(failure).__name__}: {failure})")
    try:
        raise_on_every_rank(report, "writing the export", error_type=ExportError)
    except ExportError as error:
        if error is not report:  # another rank: rank 0's report
            raise
    if failure is not None:  # rank 0: the writer's own error, outside the handler so its context stays its own
        raise failure


def export_engine(
    engine: Any,
    output_dir: str | os.PathLike,
    options: ExportOptions | None = None,
    *,
    source: dict | None = None,
) -> ExportResult | None:
    """Export the weights of the DeepSpeed ``engine`` (call on every rank). Rank 0 writes and gets the result.

    ``options`` default to ``ExportOptions()``; ``options.tag`` is not read (a running engine has no tag).
    ``source`` adds entries to the export's metadata (step, epoch, ...).
    """
    if options is None:
        options = ExportOptions()
    module = engine.module
    master = _has_fp32_master(engine)
    entries = module.state_dict(keep_vars=True)
    owners: dict[int, str] = {}
    kinds: dict[str, str] = {}
    aliases: dict[str, str] = {}
    tensors_by_name: dict[str, torch.Tensor] = {}
    keys: list[str] = []
    skipped: list[str] = []  # non-tensor entries (extra state), reported like the checkpoint exporter does
    for name, value in entries.items():
        if not isinstance(value, torch.Tensor):
            skipped.append(name)
            continue
        keys.append(name)
        if id(value) in owners:
            aliases[name] = owners[id(value)]
            continue
        owners[id(value)] = name
        tensors_by_name[name] = value
        if isinstance(value, torch.nn.Parameter):
            kinds[name] = "param" if value.requires_grad else "frozen"
        else:
            kinds[name] = "buffer"
    unwrap = wrapper_unwrapper(keys)
    keys = [unwrap(k) for k in keys]
    kinds = {unwrap(k): v for k, v in kinds.items()}
    aliases = {unwrap(a): unwrap(t) for a, t in aliases.items()}
    tensors_by_name = {unwrap(k): v for k, v in tensors_by_name.items()}
    skipped = [unwrap(k) for k in skipped]
    info = {
        "source": "live_engine",
        "zero_stage": engine.zero_optimization_stage(),
        "world_size": dist.get_world_size() if is_distributed() else 1,
        **(source or {}),
    }
    spec_of = functools.partial(_spec, tensors_by_name, kinds, master, options)
    layouts = adapter_layouts(module) if options.peft == "adapter" else []
    if layouts:  # PEFT's layout: each adapter's file and config (the default adapter in output_dir itself)
        results = [
            _write_selection(
                Path(output_dir) / layout.folder,
                options,
                select_keys(keys, kinds, aliases, rename=layout.names),
                skipped,
                info,
                layout,
                spec_of,
            )
            for layout in layouts
        ]
        return results[0]
    if options.peft == "merged":  # the base model with the adapters folded in, named and configured as the base
        merged, base = merged_tensors(module)
        layer_of = {tensor.name: tensor.layer for tensor in merged if tensor.layer is not None}
        hf_files = options.hf_files or find_hf_config(base, None)
        rename = {tensor.name: unwrap(tensor.key) for tensor in merged}
        return _write_selection(
            output_dir,
            options,
            select_keys(keys, kinds, aliases, rename=rename),
            skipped,
            info,
            None,
            functools.partial(_merged_spec, spec_of, layer_of),
            hf_files,
        )
    selection = select_keys(
        keys,
        kinds,
        aliases,
        exclude_frozen_parameters=options.exclude_frozen_parameters,
        strip_prefix=options.strip_prefix,
    )
    return _write_selection(output_dir, options, selection, skipped, info, None, spec_of, options.hf_files)


def _merged_spec(
    spec_of: Callable[[str, str], OutputTensor], layer_of: dict[str, Any], name: str, owner: str
) -> OutputTensor:
    """The tensor ``owner`` written as ``name``, with the adapters of ``layer_of[name]`` added where it has one."""
    spec = spec_of(name, owner)
    layer = layer_of.get(name)
    if layer is not None:
        spec.produce = functools.partial(_with_adapters, spec.produce, layer)
    return spec


def _with_adapters(produce: Callable[[], torch.Tensor], layer: Any) -> torch.Tensor:
    """The base weight ``produce`` gives plus each active adapter of the peft ``layer`` not merged already (peft's
    ``get_delta_weight``), computed with the layer's adapter weights gathered (a collective under ZeRO-3)."""
    import deepspeed

    weight = produce()
    adapter_params = [param for name, param in layer.named_parameters() if not name.startswith("base_layer.")]
    with deepspeed.zero.GatheredParameters(adapter_params, modifier_rank=None):
        for adapter in layer.active_adapters:
            if adapter in getattr(layer, "scaling", {}) and adapter not in layer.merged_adapters:
                weight = weight + layer.get_delta_weight(adapter).detach().to("cpu", weight.dtype)
    return weight


def _spec(
    tensors_by_name: dict[str, torch.Tensor],
    kinds: dict[str, str],
    master: bool,
    options: ExportOptions,
    name: str,
    owner: str,
) -> OutputTensor:
    """How the tensor ``owner`` is produced (a collective for a parameter) and written as ``name``."""
    value = tensors_by_name[owner]
    kind = kinds[owner]
    shape = tuple(getattr(value, "ds_shape", value.shape))
    produce: Callable[[], torch.Tensor]
    if kind == "param" and master:
        stored_dtype = torch.float32
        produce = functools.partial(_master, value)
    elif kind in ("param", "frozen"):
        stored_dtype = value.dtype
        produce = functools.partial(_gathered, value)
    else:
        stored_dtype = value.dtype
        produce = functools.partial(_on_cpu, value)
    return OutputTensor(name, shape, output_dtype(stored_dtype, options.torch_dtype), produce, kind)


def _write_selection(
    output_dir: str | os.PathLike,
    options: ExportOptions,
    selection: tuple[list[tuple[str, str]], dict[str, str]],
    skipped: list[str],
    info: dict[str, Any],
    adapter: AdapterLayout | None,
    spec_of: Callable[[str, str], OutputTensor],
    hf_files: HFConfigFiles | None = None,
) -> ExportResult | None:
    """Every rank produces the selected tensors in order; rank 0 writes them into ``output_dir`` (an adapter's file
    and config where ``adapter`` is given, else the shards and ``hf_files``) and gets the result."""
    rank = global_rank()
    check_output_dir_on_every_rank(output_dir, options.overwrite)
    stored, exported_aliases = selection
    tensors = [spec_of(name, owner) for name, owner in stored]
    metadata = safetensors_metadata(exported_aliases, options.torch_dtype, info)
    if rank != 0:
        drain(tensors)
        if is_distributed():
            dist.barrier()
        _agree_on_write(None, output_dir)  # raise too when rank 0 failed, instead of running into the next collective
        return None
    produced = 0

    def counted(produce: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            nonlocal produced
            produced += 1
            return produce()

        return run

    for tensor in tensors:
        tensor.produce = counted(tensor.produce)
    failure: BaseException | None = None
    try:
        with staged_output(output_dir, options.overwrite) as staging:
            files = write_export_files(staging, tensors, metadata, options, adapter, hf_files)
    except BaseException as error:
        # the other ranks are waiting in the collectives of the remaining tensors: take part, then fail everywhere
        failure = error
        drain(tensors[produced:])
    if is_distributed():
        dist.barrier()
    _agree_on_write(failure, output_dir)
    return ExportResult.of(output_dir, files, tensors, exported_aliases, skipped)
