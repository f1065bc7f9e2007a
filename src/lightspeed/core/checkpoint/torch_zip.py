"""Read the structure of a ``torch.save`` file without loading its tensors or running code from it.

DeepSpeed's rank files hold the flat fp32 partitions next to Adam's two moment buffers. ``torch.load`` would read
all of it (or memory-map it, which still leaves every page it touches resident). Here the pickle is unpickled with
tensors replaced by :class:`FileRegion` references (file, byte offset, dtype, shape); tensor bytes are read later,
a slice at a time, with ``readinto``. Globals outside a small allow-list (DeepSpeed's classes, Lightning
hyper-parameters, numpy scalars) become inert :class:`OpaqueObject` placeholders, so a checkpoint cannot run code.
"""

from __future__ import annotations

import builtins
import collections
import copyreg
import io
import math
import os
import pickle
import struct
import sys
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from lightspeed.core.errors import CheckpointError

__all__ = ["FileRegion", "OpaqueObject", "RegionReader", "TorchZipFile", "as_int", "load_lazy"]

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_HEADER_MAGIC = b"PK\x03\x04"
_SAFE_BUILTINS = {
    "list",
    "dict",
    "set",
    "frozenset",
    "tuple",
    "int",
    "float",
    "complex",
    "bool",
    "str",
    "bytes",
    "bytearray",
    "slice",
    "range",
    "object",
}


@dataclass
class FileRegion:
    """A contiguous run of ``numel`` elements of ``dtype`` starting at byte ``offset`` of ``path``."""

    path: Path
    offset: int
    dtype: torch.dtype
    numel: int
    shape: tuple[int, ...] = ()
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def slice(self, start: int, count: int) -> FileRegion:
        """Elements ``[start, start + count)`` of this region, as a region of its own."""
        if start < 0 or count < 0 or start + count > self.numel:
            raise CheckpointError(
                f"{self.path}: asked for elements [{start}, {start + count}) of a tensor with {self.numel}; "
                "the checkpoint's parameter shapes do not match its partitions"
            )
        return FileRegion(self.path, self.offset + start * self.itemsize, self.dtype, count, (count,))


class OpaqueObject(dict):
    """Stands in for an object whose class is not on the allow-list; keeps constructor args and state."""

    qualname = "?"
    args: tuple[Any, ...]
    state: Any
    items_list: list[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def __new__(cls, *args: Any, **kwargs: Any) -> OpaqueObject:
        obj = super().__new__(cls)
        obj.args = args
        obj.state = None
        obj.items_list = []
        return obj

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, item: Any) -> None:
        self.items_list.append(item)

    def extend(self, items: Any) -> None:
        self.items_list.extend(items)

    def __reduce__(self):  # placeholders are never pickled again
        raise TypeError(f"placeholder for {self.qualname} cannot be pickled")

    def __repr__(self) -> str:
        return f"<opaque {self.qualname} args={self.args!r}>"


_OPAQUE_CLASSES: dict[str, type[OpaqueObject]] = {}


def _opaque(module: str, name: str) -> type[OpaqueObject]:
    qualname = f"{module}.{name}"
    if qualname not in _OPAQUE_CLASSES:
        _OPAQUE_CLASSES[qualname] = type(f"Opaque_{name}", (OpaqueObject,), {"qualname": qualname})
    return _OPAQUE_CLASSES[qualname]


def as_int(value: Any) -> int:
    """An int from a plain int or an enum placeholder such as DeepSpeed's ``ZeroStageEnum(3)``."""
    if isinstance(value, OpaqueObject) and value.args:
        return int(value.args[0])
    return int(value)


def _storage_dtype(name: str) -> torch.dtype:
    if name == "UntypedStorage":
        return torch.uint8
    with warnings.catch_warnings():  # the legacy typed storage classes warn on attribute access
        warnings.simplefilter("ignore")
        dtype = getattr(getattr(torch, name, None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown storage type torch.{name} in checkpoint")
    return dtype


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


class _LazyUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, reader: TorchZipFile) -> None:
        super().__init__(file, encoding="utf-8")
        self._reader = reader

    def persistent_load(self, saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or not saved_id or saved_id[0] not in ("storage", b"storage"):
            raise CheckpointError(f"{self._reader.path}: unsupported object in checkpoint pickle: {saved_id!r}")
        storage_type, key, _location, numel = saved_id[1:5]
        dtype = storage_type.dtype if isinstance(storage_type, _StorageType) else torch.uint8
        return _StorageRef(str(key), dtype, int(numel))

    def find_class(self, module: str, name: str) -> Any:
        if module in ("torch._utils", "torch._tensor", "torch.tensor"):
            if name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
                return self._rebuild_tensor
            if name == "_rebuild_from_type_v2":
                return _rebuild_from_type_v2
            if name == "_rebuild_parameter":
                return lambda data, requires_grad, hooks: data
            if name == "_rebuild_parameter_with_state":
                return lambda data, requires_grad, hooks, state: data
        if module == "torch":
            if name.endswith("Storage"):
                return _StorageType(_storage_dtype(name))
            if name in ("Size", "device"):
                return getattr(torch, name)
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "builtins" and name in _SAFE_BUILTINS:
            return getattr(builtins, name)
        if module == "copyreg" and name == "_reconstructor":
            return copyreg._reconstructor  # type: ignore[attr-defined]  # exists, not in the stubs
        if module == "_codecs" and name == "encode":
            import codecs

            return codecs.encode
        return _opaque(module, name)

    def _rebuild_tensor(self, storage: Any, storage_offset: int, size: Any, stride: Any, *_rest: Any) -> Any:
        if not isinstance(storage, _StorageRef):
            return _opaque("torch._utils", "_rebuild_tensor_v2")(storage, storage_offset, size, stride)
        shape = tuple(int(s) for s in size)
        numel = math.prod(shape)
        contiguous, acc = [], 1
        for dim in reversed(shape):
            contiguous.append(acc)
            acc *= dim
        contiguous.reverse()
        if any(dim != 1 and int(s) != c for s, c, dim in zip(stride, contiguous, shape, strict=False)):
            raise CheckpointError(
                f"{self._reader.path}: tensor with shape {shape} and stride {tuple(stride)} is not contiguous; "
                "lightspeed only reads contiguous tensors (DeepSpeed always saves those)"
            )
        if storage_offset + numel > storage.numel:
            raise CheckpointError(f"{self._reader.path}: a tensor reaches past the end of its storage")
        itemsize = torch.empty((), dtype=storage.dtype).element_size()
        base = self._reader.record_offset(storage.key, storage.numel * itemsize)
        return FileRegion(self._reader.path, base + storage_offset * itemsize, storage.dtype, numel, shape)


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    result = func(*args)
    if isinstance(result, FileRegion) and isinstance(state, dict):
        result.attrs.update(state)
    return result


class TorchZipFile:
    """A ``torch.save`` zip archive whose pickle is read lazily: tensors become :class:`FileRegion` objects."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._zip = zipfile.ZipFile(self.path)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except (zipfile.BadZipFile, OSError) as error:
            raise CheckpointError(
                f"{self.path} is truncated or not a torch.save file ({error}); the save that wrote it was probably "
                "interrupted - use an earlier checkpoint"
            ) from None
        names = self._zip.namelist()
        pickles = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pickles) != 1:
            raise CheckpointError(f"{self.path}: not a torch.save archive (no single data.pkl record)")
        self._prefix = pickles[0][: -len("data.pkl")]
        byteorder_name = self._prefix + "byteorder"
        if byteorder_name in names:
            try:
                byteorder = self._zip.read(byteorder_name).decode(errors="replace")
            except (zipfile.BadZipFile, OSError, EOFError) as error:
                self._zip.close()
                raise CheckpointError(
                    f"{self.path} is truncated or corrupt ({error}); the save that wrote it was probably "
                    "interrupted - use an earlier checkpoint"
                ) from None
            if byteorder != sys.byteorder:
                self._zip.close()
                raise CheckpointError(f"{self.path}: written on a machine with a different byte order")
        self._file_size = self.path.stat().st_size
        self._handle: BinaryIO | None = None  # opened by the first record_offset, for all of them

    def load(self) -> Any:
        """The unpickled object with every tensor replaced by a :class:`FileRegion`."""
        import io

        try:
            data = self._zip.read(self._prefix + "data.pkl")
        except (zipfile.BadZipFile, OSError, EOFError) as error:
            raise CheckpointError(f"{self.path} is truncated or corrupt ({error})") from None
        try:
            return _LazyUnpickler(io.BytesIO(data), self).load()
        except CheckpointError:
            raise
        except Exception as error:  # any unpickling failure means the file is not what we expect
            raise CheckpointError(f"{self.path}: cannot read the checkpoint pickle ({error!r})") from None

    def record_offset(self, key: str, nbytes: int) -> int:
        """Byte offset in the archive where the data of storage ``key`` begins (records are stored uncompressed)."""
        name = f"{self._prefix}data/{key}"
        try:
            info = self._zip.getinfo(name)
        except KeyError:
            raise CheckpointError(f"{self.path}: storage record {name!r} is missing; the file is corrupt") from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{self.path}: storage {name!r} is compressed; torch.save never does that")
        if self._handle is None:
            self._handle = open(self.path, "rb")
        self._handle.seek(info.header_offset)
        header = self._handle.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size or header[:4] != _LOCAL_HEADER_MAGIC:
            raise CheckpointError(f"{self.path}: bad zip header for {name!r}; the file is corrupt")
        fields = _LOCAL_HEADER.unpack(header)
        offset = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        if offset + nbytes > self._file_size or info.file_size < nbytes:
            raise CheckpointError(f"{self.path} is truncated: storage {name!r} ends past the end of the file")
        return offset

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        self._zip.close()


def load_lazy(path: str | os.PathLike) -> Any:
    """Unpickle ``path`` with tensors as :class:`FileRegion` references (see :class:`TorchZipFile`)."""
    archive = TorchZipFile(path)
    try:
        return archive.load()
    finally:
        archive.close()


class RegionReader:
    """Reads :class:`FileRegion` bytes into caller-owned tensors, keeping each file open once."""

    def __init__(self) -> None:
        self._files: dict[Path, io.FileIO] = {}

    def read_into(self, region: FileRegion, out: torch.Tensor) -> None:
        """Fill the 1-D contiguous tensor ``out`` (``region.numel`` elements of ``region.dtype``)."""
        if out.dtype != region.dtype or out.numel() != region.numel or not out.is_contiguous():
            raise ValueError("read_into needs a contiguous tensor of the region's dtype and size")
        if region.numel == 0:
            return
        handle = self._files.get(region.path)
        if handle is None:
            handle = self._files[region.path] = open(region.path, "rb", buffering=0)
        view = out.view(-1).view(torch.uint8).numpy().data.cast("B")
        handle.seek(region.offset)
        done = 0
        while done < len(view):
            got = handle.readinto(view[done:])
            if not got:
                raise CheckpointError(
                    f"{region.path} is truncated: needed {len(view)} bytes at offset {region.offset}, "
                    f"the file ends after {done}"
                )
            done += got

    def read(self, region: FileRegion) -> torch.Tensor:
        """A new tensor with the region's data and shape."""
        out = torch.empty(region.numel, dtype=region.dtype)
        self.read_into(region, out)
        return out.view(region.shape)

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def __enter__(self) -> RegionReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
