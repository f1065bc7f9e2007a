"""Lossless narrowing of integer tensors for the wire: class labels and predictions rarely need 8 bytes each.

Gathering evaluation outputs is bandwidth-bound once the outputs are large (gloo between CPU processes moves a few
hundred MB/s on a small machine), and the typical outputs are int64 class indices below 256. Each rank picks the
narrowest integer dtype that holds its own values exactly, sends that, names it in the gather's header with a small
code, and every receiver widens each rank's rows back to the original dtype. Floating, boolean, 8-bit and wide
unsigned tensors travel as they are.

Every rank's tensors then travel as the bytes of one flat buffer (:func:`pack`), each tensor at a 16-byte boundary
so that a receiver views it in place as its wire dtype (:func:`unpack`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: code -> dtype on the wire (code 0: the tensor's own dtype)
_WIRE = {1: torch.uint8, 2: torch.int8, 3: torch.int16, 4: torch.int32}
_WIDE_INTEGERS = (torch.int16, torch.int32, torch.int64)  # the wide unsigned dtypes lack reductions in torch


def narrowest_code(tensor: torch.Tensor) -> int:
    """The code of the narrowest wire dtype that holds every value of ``tensor`` exactly (0: send it as it is)."""
    if tensor.dtype not in _WIDE_INTEGERS or tensor.numel() == 0:
        return 0
    low, high = (int(v) for v in torch.aminmax(tensor.reshape(-1)))
    for code, dtype in _WIRE.items():
        if dtype.itemsize >= tensor.dtype.itemsize:
            return 0
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return code
    return 0


def wire_dtype(code: int, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels as under ``code``."""
    if code == 0:
        return dtype
    if code not in _WIRE:
        raise ValueError(f"unknown wire code {code} for a {dtype} tensor")
    return _WIRE[code]


_ALIGN = 16  # bytes; keeps every packed tensor's offset valid for viewing it as its dtype


def pack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The bytes of several tensors in one flat uint8 tensor on ``device``, each starting at a 16-byte boundary."""
    if not tensors:
        return None
    out = torch.zeros(sum(_padded_nbytes(t.numel(), t.dtype) for t in tensors), dtype=torch.uint8, device=device)
    offset = 0
    for tensor in tensors:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        out[offset : offset + raw.numel()] = raw.to(device)
        offset += _padded_nbytes(tensor.numel(), tensor.dtype)
    return out


def unpack(raw: torch.Tensor, layout: Sequence[tuple[torch.dtype, int, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Inverse of :func:`pack` for one rank: ``layout`` lists (dtype, rows, shape of a row) per tensor."""
    out, offset = [], 0
    for dtype, rows, shape in layout:
        numel = rows * math.prod(shape)
        out.append(raw[offset : offset + numel * dtype.itemsize].view(dtype).reshape(rows, *shape))
        offset += _padded_nbytes(numel, dtype)
    return out


def _padded_nbytes(numel: int, dtype: torch.dtype) -> int:
    return -(-numel * dtype.itemsize // _ALIGN) * _ALIGN


__all__ = ["narrowest_code", "pack", "unpack", "wire_dtype"]
