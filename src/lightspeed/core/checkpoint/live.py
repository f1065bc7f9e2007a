"""Export a running DeepSpeed engine straight to safetensors, parameter by parameter.

Every rank walks the module's ``state_dict`` in the same order. For a trainable parameter all ranks assemble the
fp32 master copy (``deepspeed.utils.safe_get_full_fp32_param``, a collective); a frozen ZeRO-3 parameter is
gathered with ``GatheredParameters([param])``. Rank 0 writes each tensor as soon as it is assembled and drops it,
so no rank ever holds more than one full parameter. The result is bit-identical to exporting the checkpoint the
engine would save at this moment.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightspeed.core.checkpoint.errors import ExportError
from lightspeed.core.checkpoint.exporter import ExportResult
from lightspeed.core.checkpoint.plan import (
    OutputTensor,
    output_dtype,
    resolve_dtype,
    safetensors_metadata,
    select_keys,
    wrapper_unwrapper,
)
from lightspeed.core.checkpoint.safetensors_writer import drain, parse_shard_size, write_shards
from lightspeed.core.checkpoint.staging import check_output_dir, staged_output


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _has_fp32_master(engine: Any) -> bool:
    stage = engine.zero_optimization_stage()
    return stage > 0 or bool(getattr(engine, "bfloat16_enabled", lambda: False)())


def _gathered(param: torch.nn.Parameter) -> torch.Tensor:
    if hasattr(param, "ds_id"):  # ZeRO-3 partitioned parameter
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.detach().to("cpu", copy=True)
    return param.detach().to("cpu")


def _master(param: torch.nn.Parameter) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param)
    if full is None:
        return _gathered(param)
    return full.detach().to("cpu").view(getattr(param, "ds_shape", param.shape))


def _from_rank_zero(problem: str | None) -> str | None:
    """Rank 0's ``problem`` on every rank (a collective: every rank must call it)."""
    if _distributed():
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    return problem


def _agree(problem: str | None) -> None:
    """Raise the same ExportError on every rank when rank 0 found a problem (so no rank waits in a collective)."""
    problem = _from_rank_zero(problem)
    if problem:
        raise ExportError(problem)


def export_engine(
    engine: Any,
    output_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "fp32",
    max_shard_size: int | str | None = "5GB",
    exclude_frozen: bool = False,
    strip_prefix: str | None = None,
    overwrite: bool = False,
    source: dict | None = None,
) -> ExportResult | None:
    """Export the weights of the DeepSpeed ``engine`` (call on every rank). Rank 0 writes and gets the result."""
    requested = resolve_dtype(dtype)
    max_bytes = parse_shard_size(max_shard_size)
    rank = dist.get_rank() if _distributed() else 0
    problem = None
    if rank == 0:
        try:
            check_output_dir(output_dir, overwrite)
        except ExportError as error:
            problem = str(error)
    _agree(problem)

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
    stored, exported_aliases = select_keys(
        keys, kinds, aliases, exclude_frozen=exclude_frozen, strip_prefix=strip_prefix
    )

    def spec(name: str, owner: str) -> OutputTensor:
        value = tensors_by_name[owner]
        kind = kinds[owner]
        shape = tuple(getattr(value, "ds_shape", value.shape))
        produce: Callable[[], torch.Tensor]
        if kind == "param" and master:
            stored_dtype = torch.float32
            produce = lambda p=value: _master(p)  # noqa: E731
        elif kind in ("param", "frozen"):
            stored_dtype = value.dtype
            produce = lambda p=value: _gathered(p)  # noqa: E731
        else:
            stored_dtype = value.dtype
            produce = lambda b=value: b.detach().to("cpu")  # noqa: E731
        return OutputTensor(name, shape, output_dtype(stored_dtype, requested), produce, kind)

    tensors = [spec(name, owner) for name, owner in stored]
    info = {"source": "live_engine", "zero_stage": engine.zero_optimization_stage(),
            "world_size": dist.get_world_size() if _distributed() else 1, **(source or {})}
    metadata = safetensors_metadata(exported_aliases, requested, info)
    if rank != 0:
        drain(tensors)
        if _distributed():
            dist.barrier()
        _agree(None)  # rank 0's outcome: raise too when it failed, instead of running on into the next collective
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
        with staged_output(output_dir, overwrite) as staging:
            files = write_shards(staging, tensors, max_bytes, metadata)
    except BaseException as error:
        # the other ranks are waiting in the collectives of the remaining tensors: take part, then fail everywhere
        failure = error
        drain(tensors[produced:])
    if _distributed():
        dist.barrier()
    _from_rank_zero(None if failure is None else f"rank 0 could not write the export to {output_dir} ({type(failure).__name__}: {failure})")
    if failure is not None:
        raise failure
    return ExportResult(
        Path(output_dir), files, len(tensors), sum(t.nbytes for t in tensors), exported_aliases, skipped
    )
