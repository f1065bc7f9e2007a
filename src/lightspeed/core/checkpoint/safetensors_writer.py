"""Write tensors into safetensors shards one tensor at a time, following the Hugging Face layout.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, byte range) and the raw bytes.
All shapes and dtypes are known before any data is read, so each header is written first and every tensor is
produced, written and dropped in turn: resident memory is one tensor, not one shard or the model. Files are named
``model.safetensors`` or ``model-0000k-of-0000N.safetensors`` with ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from lightspeed.core.checkpoint.plan import OutputTensor
from lightspeed.core.common.sizes import parse_size
from lightspeed.core.errors import ExportError

__all__ = [
    "INDEX_FILE",
    "SAFETENSORS_DTYPES",
    "SINGLE_FILE",
    "Progress",
    "drain",
    "parse_shard_size",
    "plan_shards",
    "shard_names",
    "write_file",
    "write_shards",
]

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

Progress = Callable[[int, int], None]  # (bytes written so far, total bytes)


def parse_shard_size(value: int | str | None) -> int | None:
    """``"2GB"`` (10^9), ``"500MiB"`` (2^20) or an int of bytes -> bytes; None means one file however large."""
    if value is None:
        return None
    return parse_size(value, "max shard size", ExportError)


def plan_shards(tensors: list[OutputTensor], max_shard_bytes: int | None) -> list[list[OutputTensor]]:
    """Cut the ordered tensor list into consecutive shards of at most ``max_shard_bytes`` (a bigger tensor alone)."""
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if max_shard_bytes is not None and shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(tensors: list[OutputTensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for tensor in tensors:
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ExportError(f"{tensor.name}: dtype {tensor.dtype} cannot be written to safetensors")
        header[tensor.name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return encoded + b" " * (-len(encoded) % 8)  # keep the data 8-byte aligned


def _tensor_bytes(tensor: torch.Tensor, spec: OutputTensor) -> memoryview:
    if tuple(tensor.shape) != tuple(spec.shape):
        raise ExportError(f"{spec.name}: produced shape {tuple(tensor.shape)}, expected {spec.shape}")
    tensor = tensor.detach().to("cpu")
    if tensor.dtype != spec.dtype:
        tensor = tensor.to(spec.dtype)
    tensor = tensor.contiguous().reshape(-1)
    return tensor.view(torch.uint8).numpy().data.cast("B")


def write_file(
    path: Path, tensors: list[OutputTensor], metadata: dict[str, str], progress: Callable[[int], None]
) -> None:
    """Write one safetensors file, producing each tensor only when its turn comes."""
    header = _header(tensors, metadata)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)))
        handle.write(header)
        for spec in tensors:
            data = _tensor_bytes(spec.produce(), spec)
            if len(data) != spec.nbytes:
                raise ExportError(f"{spec.name}: produced {len(data)} bytes, expected {spec.nbytes}")
            handle.write(data)
            del data
            progress(spec.nbytes)
        handle.flush()
        os.fsync(handle.fileno())


def write_shards(
    directory: Path,
    tensors: list[OutputTensor],
    max_shard_bytes: int | None,
    metadata: dict[str, str],
    progress: Progress | None = None,
    file_name: str | None = None,
) -> list[str]:
    """Write ``tensors`` as HF-style safetensors shards (+ index when more than one) into ``directory``; with
    ``file_name`` as that one file (``max_shard_bytes`` must be None)."""
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ExportError(f"two tensors would be exported under the same name: {duplicates}")
    shards = plan_shards(tensors, max_shard_bytes)
    files = shard_names(len(shards)) if file_name is None else [file_name]
    total = sum(t.nbytes for t in tensors)
    done = 0

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total)

    for name, shard in zip(files, shards, strict=True):
        write_file(directory / name, shard, metadata, advance)
    if len(files) > 1:
        index = {
            "metadata": {"total_size": total, **metadata},
            "weight_map": {t.name: name for name, shard in zip(files, shards, strict=True) for t in shard},
        }
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files + ([INDEX_FILE] if len(files) > 1 else [])


def drain(tensors: list[OutputTensor]) -> None:
    """Produce every tensor in the order :func:`write_shards` writes them, keeping nothing (non-writing ranks take
    part in the collectives that assemble each tensor)."""
    for spec in tensors:
        spec.produce()
