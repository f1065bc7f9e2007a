"""Load the weights of a ZeRO checkpoint (any stage, any world size) into a live module, tensor by tensor.

Used for evaluation from a checkpoint (``Trainer.validate/test/predict(ckpt_path=...)``) in a process that did not
train: DeepSpeed's inference engine has no optimizer to load ZeRO shards into, so DeepSpeed's own
``load_checkpoint`` cannot restore them. Instead every tensor's full value is assembled from the rank files
(:mod:`lightspeed.core.checkpoint.zero_reader`, fp32 master weights where the checkpoint has them) and copied into
the module: a ZeRO-3 partitioned parameter under ``deepspeed.zero.GatheredParameters(modifier_rank=0)`` (rank 0
reads it, DeepSpeed re-partitions it), anything else by every rank. One tensor is in memory at a time, never the
whole model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightspeed.core.checkpoint.loading import describe_key_mismatch
from lightspeed.core.checkpoint.torch_zip import RegionReader
from lightspeed.core.checkpoint.zero_reader import TensorSource, ZeroCheckpoint, assemble, read_zero_checkpoint
from lightspeed.core.common.distributed import raise_on_every_rank
from lightspeed.core.errors import CheckpointError

__all__ = [
    "DEEPSPEED_STATE_KEYS",
    "check_fits",
    "load_full_state_dict",
    "load_tensors",
    "load_zero_weights",
    "read_client_state",
    "read_structure",
]

#: entries of DeepSpeed's model states files that are DeepSpeed's own, not the client state (Lightning's)
DEEPSPEED_STATE_KEYS = frozenset(
    {
        "module",
        "optimizer",
        "lr_scheduler",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "data_sampler",
        "random_ltd",
        "buffer_names",
        "param_shapes",
        "frozen_param_shapes",
        "frozen_param_fragments",
        "shared_params",
        "ds_config",
        "ds_version",
    }
)


def read_structure(checkpoint: str | os.PathLike) -> ZeroCheckpoint:
    """Where every tensor of ``checkpoint`` lives; raises :class:`CheckpointError` naming a missing rank file."""
    return read_zero_checkpoint(checkpoint)


def read_client_state(structure: ZeroCheckpoint) -> dict[str, Any]:
    """The client state (what Lightning saved next to the weights) from the first model states file.

    The file is memory-mapped, so the weights stored in it are not read.
    """
    files = structure.files
    path = files.model_files.get(0) or files.tag_dir / "mp_rank_00_model_states.pt"
    if not Path(path).is_file():
        raise CheckpointError(f"{files.tag_dir} is missing {Path(path).name}")
    state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    return {key: value for key, value in state.items() if key not in DEEPSPEED_STATE_KEYS}


def _targets(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    targets: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        targets[name] = param
    for name, buffer in module.named_buffers(remove_duplicate=False):
        targets[name] = buffer
    return targets


def _expected_keys(module: torch.nn.Module, frozen_excluded: bool) -> set[str]:
    """The keys a checkpoint of ``module`` holds: its persistent tensors, less its frozen parameters when the save
    left them out (they keep their values as built, e.g. from the pretrained files)."""
    keys = _persistent_keys(module)
    if frozen_excluded:
        keys -= {name for name, param in module.named_parameters(remove_duplicate=False) if not param.requires_grad}
    return keys


def _persistent_keys(module: torch.nn.Module) -> set[str]:
    """The tensor keys of ``module.state_dict()`` without materialising ZeRO-3 partitioned parameters."""
    keys: set[str] = set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in sub._parameters.items():
            if param is not None:
                keys.add(dot + name)
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                keys.add(dot + name)
    return keys


def _model_shape(target: torch.Tensor) -> tuple[int, ...]:
    """The full shape of a module tensor, also of a ZeRO-3 partitioned parameter (whose own shape is empty)."""
    return tuple(getattr(target, "ds_shape", target.shape))


@contextmanager
def _writable(target: torch.Tensor, rank: int) -> Iterator[bool]:
    """Make ``target`` whole for the block and say whether this rank writes it: a ZeRO-3 partitioned parameter is
    gathered, written by rank 0 and partitioned again afterwards (a collective); any other tensor by every rank."""
    if hasattr(target, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
            yield rank == 0
    else:
        yield True


def load_zero_weights(
    module: torch.nn.Module,
    structure: ZeroCheckpoint,
    *,
    rank: int,
    strict: bool = True,
    frozen_excluded: bool = False,
) -> None:
    """Copy every tensor of ``structure`` into ``module`` (ZeRO-3 partitioned or not), one tensor at a time.

    Every rank must call this with the same ``structure`` (partitioned parameters are re-partitioned with a
    collective per parameter). ``strict`` refuses checkpoint tensors the module lacks and module tensors the
    checkpoint lacks (but for frozen parameters when the save left them out: ``frozen_excluded``), before anything
    is copied.
    """
    targets = _targets(module)
    stored = {source.name for source in structure.tensors} | set(structure.aliases)
    if strict:
        unexpected = sorted(stored - set(targets))
        missing = sorted(_expected_keys(module, frozen_excluded) - stored)
        if unexpected or missing:
            labels = ("missing from the checkpoint", "not in the model")
            mismatch = describe_key_mismatch(missing, unexpected, labels, ", ".join)
            raise CheckpointError(
                f"{structure.files.tag_dir} does not fit the model ({mismatch}). Pass the checkpoint of "
                "this model, or set `model.strict_loading = False` to load the matching tensors only."
            )
    reader = RegionReader()
    failure: CheckpointError | None = None
    try:
        for source in structure.tensors:
            target = targets.get(source.name)
            if target is None:
                continue
            model_shape = _model_shape(target)
            if failure is None and tuple(source.shape) != model_shape:
                failure = CheckpointError(
                    f"{structure.files.tag_dir}: {source.name!r} has shape {tuple(source.shape)} in the checkpoint "
                    f"but {model_shape} in the model"
                )
            # after a failure the loop goes on without reading, so that every rank runs the same collectives
            with _writable(target, rank) as writes:
                if writes and failure is None:
                    failure = _copy(source, reader, target)
    finally:
        reader.close()
    if failure is not None:
        raise failure


def _copy(source: TensorSource, reader: RegionReader, target: torch.Tensor) -> CheckpointError | None:
    try:
        value = assemble(source, reader)
    except (CheckpointError, OSError, RuntimeError) as err:
        return err if isinstance(err, CheckpointError) else CheckpointError(f"reading {source.name!r}: {err}")
    with torch.no_grad():
        target.data.copy_(value)
    return None


def check_fits(
    module: torch.nn.Module, structure: ZeroCheckpoint, *, strict: bool = True, frozen_excluded: bool = False
) -> None:
    """Raise one :class:`CheckpointError` listing every tensor of ``structure`` whose shape differs from the
    module's (and, with ``strict``, the tensors only one side has); reads no tensor data. ``frozen_excluded``: the
    save left frozen parameters out, so the module's frozen parameters may be missing (they keep their values as
    built, e.g. from the pretrained files)."""
    targets = _targets(module)
    problems = []
    for source in structure.tensors:
        target = targets.get(source.name)
        if target is None:
            continue
        model_shape = _model_shape(target)
        if tuple(source.shape) != model_shape:
            problems.append(f"{source.name}: {tuple(source.shape)} in the checkpoint, {model_shape} in the model")
    if strict:
        stored = {source.name for source in structure.tensors} | set(structure.aliases)
        problems += [f"{name}: not in the model" for name in sorted(stored - set(targets))]
        expected = _expected_keys(module, frozen_excluded)
        problems += [f"{name}: missing from the checkpoint" for name in sorted(expected - stored)]
    if problems:
        listing = "\n  ".join(problems)
        raise CheckpointError(
            f"Checkpoint {str(structure.files.tag_dir.parent)!r} is not a checkpoint of this model; "
            f"{len(problems)} parameter(s) do not match:\n  {listing}\nResume from a checkpoint of the same model "
            "(or load matching weights only with `model.strict_loading = False` outside `fit`)."
        )


def load_full_state_dict(
    module: torch.nn.Module,
    state_dict: dict[str, Any],
    *,
    rank: int,
    optimizer: Any | None = None,
    strict: bool = True,
    source: str = "the file",
) -> tuple[list[str], list[str]]:
    """Copy a consolidated ``state_dict`` (a torch or Lightning checkpoint's, or an export's) into ``module``, ZeRO-3
    partitioned or not (see :func:`load_tensors`); returns the module keys it lacked and its keys the module lacks."""
    tensors = {key: value for key, value in state_dict.items() if isinstance(value, torch.Tensor)}
    shapes = {key: tuple(value.shape) for key, value in tensors.items()}
    return load_tensors(
        module, shapes, tensors.__getitem__, rank=rank, optimizer=optimizer, strict=strict, source=source
    )


def load_tensors(
    module: torch.nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    read: Callable[[str], torch.Tensor],
    *,
    rank: int,
    optimizer: Any | None = None,
    strict: bool = True,
    source: str = "the file",
) -> tuple[list[str], list[str]]:
    """Copy the tensors ``shapes`` names, each read with ``read(key)`` when it is needed, into ``module`` (ZeRO-3
    partitioned or not), one tensor at a time, then into the fp32 master copies of the ZeRO ``optimizer`` (None: no
    optimizer), so its next step starts from these weights; returns the module keys it lacked and its keys the module
    lacks. A module tensor registered under several names (tied weights) needs only one of them.

    A collective: every rank calls it with the same keys. A partitioned parameter is gathered, written by rank 0
    alone (only rank 0 reads its value) and partitioned again; any other tensor is read and written by every rank.
    Shapes that differ, and with ``strict`` missing or unexpected keys, are one :class:`CheckpointError` naming them
    (``source``: how to name the file) before anything is read."""
    targets = _targets(module)
    names_of: dict[int, list[str]] = {}
    for key, target in targets.items():
        names_of.setdefault(id(target), []).append(key)
    persistent = _persistent_keys(module)
    missing = sorted(
        key for key in persistent if not any(name in shapes for name in names_of.get(id(targets.get(key)), [key]))
    )
    unexpected = sorted(set(shapes) - set(targets))
    problems = [
        f"{key}: {tuple(shape)} in {source}, {_model_shape(targets[key])} in the model"
        for key, shape in shapes.items()
        if key in targets and tuple(shape) != _model_shape(targets[key])
    ]
    if strict:
        problems += [f"{key}: missing from {source}" for key in missing]
        problems += [f"{key}: not in the model" for key in unexpected]
    if problems:
        listing = "\n  ".join(problems)
        raise CheckpointError(
            f"{source[0].upper() + source[1:]} does not fit the model; {len(problems)} tensor(s):\n  {listing}\n"
            "Load the weights of this model, or pass strict=False to load the matching tensors only."
        )
    copied: set[int] = set()
    failure: CheckpointError | None = None
    for key, target in targets.items():
        if key not in shapes or id(target) in copied:
            continue
        copied.add(id(target))  # a tensor registered under several names is written once
        # after a failure the loop goes on without reading, so that every rank runs the same collectives
        with _writable(target, rank) as writes, torch.no_grad():
            if writes and failure is None:
                try:
                    target.data.copy_(read(key))
                except Exception as err:  # noqa: BLE001 - a bad file: reported on every rank below
                    failure = CheckpointError(f"reading {key!r} from {source}: {err}")
    raise_on_every_rank(failure, f"Loading {source}", error_type=CheckpointError)
    if optimizer is not None and hasattr(optimizer, "refresh_fp32_params"):
        optimizer.refresh_fp32_params()  # the ZeRO optimizer's fp32 copies would still hold the weights from before
    return missing, unexpected
