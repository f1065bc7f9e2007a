"""Export a DeepSpeed ZeRO checkpoint directory or a single-file Lightning checkpoint to consolidated safetensors,
streaming one tensor at a time."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightspeed.core.checkpoint.errors import CheckpointError, ExportError
from lightspeed.core.checkpoint.lightning_file_reader import read_lightning_file
from lightspeed.core.checkpoint.plan import (
    OutputTensor,
    output_dtype,
    resolve_dtype,
    safetensors_metadata,
    select_keys,
)
from lightspeed.core.checkpoint.safetensors_writer import Progress, parse_shard_size, write_shards
from lightspeed.core.checkpoint.staging import check_output_dir, staged_output
from lightspeed.core.checkpoint.torch_zip import RegionReader
from lightspeed.core.checkpoint.zero_reader import TensorSource, assemble, read_zero_checkpoint


@dataclass
class ExportResult:
    """What an export wrote."""

    output_dir: Path
    files: list[str]
    num_tensors: int
    total_bytes: int
    tied: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def export_zero_checkpoint(
    checkpoint: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "fp32",
    max_shard_size: int | str | None = "5GB",
    tag: str | None = None,
    exclude_frozen: bool = False,
    strip_prefix: str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ExportResult:
    """Write the consolidated weights of ``checkpoint`` as safetensors shards into ``output_dir``.

    Trainable parameters come from the fp32 master partitions (exact), frozen parameters and buffers from the
    model states; floating tensors are converted to ``dtype``. Nothing is written unless the whole export
    succeeds; the output directory must be empty or missing unless ``overwrite``.
    """
    requested = resolve_dtype(dtype)
    max_bytes = parse_shard_size(max_shard_size)
    check_output_dir(output_dir, overwrite)
    checkpoint_info = read_zero_checkpoint(checkpoint, tag)
    kinds = {source.name: source.kind for source in checkpoint_info.tensors}
    if exclude_frozen and checkpoint_info.stage == 0 and "module" in kinds.values():
        raise ExportError(
            f"{checkpoint_info.files.tag_dir}: a ZeRO stage 0 checkpoint does not record which parameters were "
            "frozen, so exclude_frozen cannot be honoured; export everything instead"
        )
    source = {
        "source": "deepspeed_checkpoint",
        "zero_stage": checkpoint_info.stage,
        "world_size": checkpoint_info.world_size,
        "tag": checkpoint_info.files.tag,
        "deepspeed_version": checkpoint_info.ds_version,
    }
    return _write_export(
        checkpoint_info.tensors, checkpoint_info.aliases, checkpoint_info.skipped, source, output_dir, requested,
        max_bytes, exclude_frozen=exclude_frozen, strip_prefix=strip_prefix, overwrite=overwrite, progress=progress,
    )


def export_lightning_file(
    checkpoint: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "fp32",
    max_shard_size: int | str | None = "5GB",
    exclude_frozen: bool = False,
    strip_prefix: str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ExportResult:
    """Write the ``state_dict`` of the single-file Lightning checkpoint ``checkpoint`` as safetensors shards.

    Tensors are exported as saved (the training dtype), converted to ``dtype`` when floating; same guarantees as
    :func:`export_zero_checkpoint`. ``exclude_frozen`` is refused: such a file does not record ``requires_grad``.
    """
    requested = resolve_dtype(dtype)
    max_bytes = parse_shard_size(max_shard_size)
    check_output_dir(output_dir, overwrite)
    checkpoint_info = read_lightning_file(checkpoint)
    if exclude_frozen:
        raise ExportError(
            f"{checkpoint_info.path}: a single-file Lightning checkpoint does not record which parameters were frozen "
            "(its state_dict holds plain tensors, without requires_grad), so exclude_frozen cannot be honoured; "
            "export everything, or use strip_prefix to keep one sub-module"
        )
    source = {"source": "lightning_checkpoint", "file": checkpoint_info.path.name, **checkpoint_info.info}
    return _write_export(
        checkpoint_info.tensors, checkpoint_info.aliases, checkpoint_info.skipped, source, output_dir, requested,
        max_bytes, exclude_frozen=False, strip_prefix=strip_prefix, overwrite=overwrite, progress=progress,
    )


def export_checkpoint_path(
    checkpoint: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "fp32",
    max_shard_size: int | str | None = "5GB",
    tag: str | None = None,
    exclude_frozen: bool = False,
    strip_prefix: str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ExportResult:
    """Export ``checkpoint`` whatever its layout: a file is a single-file Lightning checkpoint, a directory a
    DeepSpeed checkpoint (its save directory or a tag folder). The options are those of the two exporters."""
    path = Path(checkpoint)
    options = dict(dtype=dtype, max_shard_size=max_shard_size, exclude_frozen=exclude_frozen,
                   strip_prefix=strip_prefix, overwrite=overwrite, progress=progress)
    if path.is_file():
        if tag is not None:
            raise CheckpointError(
                f"{path} is a single-file checkpoint, which has no tags; leave out tag=... (--tag on the command "
                "line), which only selects a tag of a DeepSpeed checkpoint directory"
            )
        return export_lightning_file(path, output_dir, **options)
    return export_zero_checkpoint(path, output_dir, tag=tag, **options)


def _write_export(
    sources: list[TensorSource],
    source_aliases: dict[str, str],
    skipped: list[str],
    source_info: dict,
    output_dir: str | os.PathLike,
    requested: torch.dtype,
    max_bytes: int | None,
    *,
    exclude_frozen: bool,
    strip_prefix: str | None,
    overwrite: bool,
    progress: Progress | None,
) -> ExportResult:
    """Choose the keys, then stream every chosen tensor from the checkpoint files into staged shards."""
    by_name = {source.name: source for source in sources}
    kinds = {name: source.kind for name, source in by_name.items()}
    keys = [source.name for source in sources] + list(source_aliases)
    stored, aliases = select_keys(
        keys, kinds, source_aliases, exclude_frozen=exclude_frozen, strip_prefix=strip_prefix
    )
    reader = RegionReader()

    def producer(source: TensorSource):
        return lambda: assemble(source, reader)

    tensors = [
        OutputTensor(name, by_name[owner].shape, output_dtype(by_name[owner].dtype, requested),
                     producer(by_name[owner]), by_name[owner].kind)
        for name, owner in stored
    ]
    metadata = safetensors_metadata(aliases, requested, source_info)
    with reader, staged_output(output_dir, overwrite) as staging:
        files = write_shards(staging, tensors, max_bytes, metadata, progress)
    return ExportResult(Path(output_dir), files, len(tensors), sum(t.nbytes for t in tensors), aliases, skipped)
