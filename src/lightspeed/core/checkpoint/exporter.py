"""Export a DeepSpeed ZeRO checkpoint directory or a single-file Lightning checkpoint to consolidated safetensors,
streaming one tensor at a time."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightspeed.core.checkpoint.hf_config import HFConfigFiles
from lightspeed.core.checkpoint.lightning_file_reader import LightningFileCheckpoint, read_lightning_file
from lightspeed.core.checkpoint.options import ExportOptions
from lightspeed.core.checkpoint.plan import OutputTensor, output_dtype, safetensors_metadata, select_keys
from lightspeed.core.checkpoint.safetensors_writer import Progress, write_shards
from lightspeed.core.checkpoint.torch_zip import RegionReader
from lightspeed.core.checkpoint.zero_reader import TensorSource, ZeroCheckpoint, assemble, read_zero_checkpoint
from lightspeed.core.errors import CheckpointError, ExportError
from lightspeed.core.peft.layout import ADAPTER_WEIGHTS, AdapterLayout
from lightspeed.core.reliability.staging import check_output_dir, several_models_in, staged_output

__all__ = [
    "ExportResult",
    "export_checkpoint_path",
    "write_export_files",
]


@dataclass
class ExportResult:
    """What an export wrote.

    Attributes:
        output_dir: the directory written.
        files: the files written, relative to ``output_dir``.
        num_tensors: tensors written.
        total_bytes: bytes of tensor data written.
        tied: tied weights: each name not written -> the name written in its place (restored by ``load_exported``).
        skipped: state_dict entries that are not tensors (extra state), not written.
        models: with several models (``models=``): each model's own result, by name (its files in
            ``output_dir/<name>/``).
    """

    output_dir: Path
    files: list[str]
    num_tensors: int
    total_bytes: int
    tied: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    #: a checkpoint of several models (one engine each): each model's own export, in ``output_dir/<name>``
    models: dict[str, ExportResult] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        output_dir: str | os.PathLike,
        files: list[str],
        tensors: list[OutputTensor],
        tied: dict[str, str],
        skipped: list[str],
    ) -> ExportResult:
        """The result of writing ``tensors`` into ``files`` (the one place the counts are taken)."""
        return cls(Path(output_dir), files, len(tensors), sum(t.nbytes for t in tensors), tied, skipped)


def _export_zero_checkpoint(
    checkpoint_info: ZeroCheckpoint, output_dir: str | os.PathLike, options: ExportOptions, progress: Progress | None
) -> ExportResult:
    """Write the consolidated weights of the DeepSpeed checkpoint read as ``checkpoint_info`` as safetensors shards
    into ``output_dir``.

    Trainable parameters come from the fp32 master partitions (exact), frozen parameters and buffers from the
    model states; floating tensors are converted to ``options.dtype``. Nothing is written unless the whole export
    succeeds.
    """
    kinds = {source.name: source.kind for source in checkpoint_info.tensors}
    if options.exclude_frozen_parameters and checkpoint_info.stage == 0 and "module" in kinds.values():
        raise ExportError(
            f"{checkpoint_info.files.tag_dir}: a ZeRO stage 0 checkpoint does not record which parameters were "
            "frozen, so exclude_frozen_parameters cannot be honoured; export everything instead"
        )
    source = {
        "source": "deepspeed_checkpoint",
        "zero_stage": checkpoint_info.stage,
        "world_size": checkpoint_info.world_size,
        "tag": checkpoint_info.files.tag,
        "deepspeed_version": checkpoint_info.ds_version,
    }
    if options.peft == "merged" and checkpoint_info.adapters:
        raise ExportError(
            f"{checkpoint_info.files.tag_dir}: a merged export of a PEFT model is written from the running engine "
            "(ZeroExport(peft='merged')); checkpoints leave the base model out by default. Export the adapter "
            "(peft='adapter'), load it onto the base model with PeftModel.from_pretrained and call merge_and_unload()."
        )
    saved_layouts = checkpoint_info.adapters if options.peft == "adapter" else []
    layouts = [AdapterLayout.from_state(state) for state in saved_layouts]
    if layouts:  # PEFT's layout, as the run's live export writes it (the default adapter in output_dir itself)
        results = [
            _write_export(checkpoint_info, source, Path(output_dir) / layout.folder, options, progress, layout)
            for layout in layouts
        ]
        return results[0]
    return _write_export(checkpoint_info, source, output_dir, options, progress)


def _export_lightning_file(
    checkpoint_info: LightningFileCheckpoint,
    output_dir: str | os.PathLike,
    options: ExportOptions,
    progress: Progress | None,
) -> ExportResult:
    """Write the ``state_dict`` of a single-file Lightning checkpoint as safetensors shards.

    Tensors are exported as saved (the training dtype), converted to ``options.dtype`` when floating; same
    guarantees as :func:`_export_zero_checkpoint`. ``exclude_frozen_parameters`` is refused: such a file does not
    record ``requires_grad``.
    """
    if options.exclude_frozen_parameters:
        raise ExportError(
            f"{checkpoint_info.path}: a single-file Lightning checkpoint does not record which parameters were frozen "
            "(its state_dict holds plain tensors, without requires_grad), so exclude_frozen_parameters cannot be "
            "honoured; export everything, or use strip_prefix to keep one sub-module"
        )
    source = {"source": "lightning_checkpoint", "file": checkpoint_info.path.name, **checkpoint_info.info}
    return _write_export(checkpoint_info, source, output_dir, options, progress)


def export_checkpoint_path(
    checkpoint: str | os.PathLike | Sequence[str | os.PathLike],
    output_dir: str | os.PathLike,
    options: ExportOptions,
    progress: Progress | None = None,
) -> ExportResult:
    """Export ``checkpoint`` whatever its layout: a file is a single-file Lightning checkpoint, a directory a
    DeepSpeed checkpoint (its save directory or a tag folder); a list: every node's directory of a node-local
    DeepSpeed checkpoint. The output directory must be empty or missing unless ``options.overwrite``."""
    check_output_dir(output_dir, options.overwrite)
    if not isinstance(checkpoint, (str, os.PathLike)):
        node_local = read_zero_checkpoint(list(checkpoint), options.tag)
        return _export_zero_checkpoint(node_local, output_dir, options, progress)
    path = Path(checkpoint)
    models = several_models_in(path)
    if models:
        return _export_models(path, models, output_dir, options, progress)
    if path.is_file():
        if options.tag is not None:
            raise CheckpointError(
                f"{path} is a single-file checkpoint, which has no tags; leave out tag=... (--tag on the command "
                "line), which only selects a tag of a DeepSpeed checkpoint directory"
            )
        return _export_lightning_file(read_lightning_file(path), output_dir, options, progress)
    return _export_zero_checkpoint(read_zero_checkpoint(path, options.tag), output_dir, options, progress)


def _export_models(
    path: Path, models: list[str], output_dir: str | os.PathLike, options: ExportOptions, progress: Progress | None
) -> ExportResult:
    """Each trained model of a several-model checkpoint into ``output_dir/<name>``, all committed together."""
    results: dict[str, ExportResult] = {}
    with staged_output(output_dir, options.overwrite) as staging:
        for name in models:
            checkpoint_info = read_zero_checkpoint(path / name, options.tag)
            in_staging = dataclasses.replace(options, overwrite=False)
            results[name] = _export_zero_checkpoint(checkpoint_info, staging / name, in_staging, progress)
    return ExportResult(
        Path(output_dir),
        [f"{name}/{file}" for name, result in results.items() for file in result.files],
        sum(r.num_tensors for r in results.values()),
        sum(r.total_bytes for r in results.values()),
        models={name: dataclasses.replace(r, output_dir=Path(output_dir) / name) for name, r in results.items()},
    )


def _write_export(
    checkpoint: ZeroCheckpoint | LightningFileCheckpoint,
    source_info: dict,
    output_dir: str | os.PathLike,
    options: ExportOptions,
    progress: Progress | None,
    adapter: AdapterLayout | None = None,
) -> ExportResult:
    """Choose the keys (an adapter's, where ``adapter`` is given), then stream every chosen tensor from the checkpoint
    files into staged shards (the adapter's one file and its config)."""
    by_name = {source.name: source for source in checkpoint.tensors}
    kinds = {name: source.kind for name, source in by_name.items()}
    keys = [source.name for source in checkpoint.tensors] + list(checkpoint.aliases)
    stored, aliases = select_keys(
        keys,
        kinds,
        checkpoint.aliases,
        exclude_frozen_parameters=options.exclude_frozen_parameters,
        strip_prefix=options.strip_prefix,
        rename=adapter.names if adapter is not None else None,
    )
    reader = RegionReader()

    def producer(source: TensorSource):
        return lambda: assemble(source, reader)

    tensors = [
        OutputTensor(
            name,
            by_name[owner].shape,
            output_dtype(by_name[owner].dtype, options.torch_dtype),
            producer(by_name[owner]),
            by_name[owner].kind,
        )
        for name, owner in stored
    ]
    metadata = safetensors_metadata(aliases, options.torch_dtype, source_info)
    with reader, staged_output(output_dir, options.overwrite) as staging:
        files = write_export_files(staging, tensors, metadata, options, adapter, options.hf_files, progress)
    return ExportResult.of(output_dir, files, tensors, aliases, checkpoint.skipped)


def write_export_files(
    staging: Path,
    tensors: list[OutputTensor],
    metadata: dict[str, str],
    options: ExportOptions,
    adapter: AdapterLayout | None,
    hf_files: HFConfigFiles | None,
    progress: Progress | None = None,
) -> list[str]:
    """Write an export's files into ``staging``: an adapter's one ``adapter_model.safetensors`` and its config where
    ``adapter`` is given, else the shards and ``hf_files``; returns the names written. Shared by the checkpoint and
    live-engine exports."""
    if adapter is not None:
        files = write_shards(staging, tensors, None, metadata, progress, file_name=ADAPTER_WEIGHTS)
        return files + adapter.write_config(staging)
    files = write_shards(staging, tensors, options.max_shard_bytes, metadata, progress)
    return files + (hf_files.write(staging) if hf_files is not None else [])
