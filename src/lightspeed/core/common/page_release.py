"""Giving the pages of a CPU tensor back to the operating system while the tensor stays allocated.

A tensor's memory comes from ``malloc``, i.e. private anonymous pages. ``madvise(MADV_DONTNEED)`` on such pages frees
them at once; the next access maps a fresh zero-filled page. So a tensor whose contents are no longer needed, or whose
contents are to become zeros, can stop costing resident memory without being freed, and costs it again only for the
pages that are written later. Only the pages lying wholly inside the tensor are given back: the first and last pages
may hold other data.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from typing import Any

import torch

__all__ = ["byte_range", "give_back_pages", "zero_without_touching"]

_MADV_DONTNEED = 4  # Linux's value (asm-generic/mman-common.h)


@functools.cache
def _madvise() -> Any:
    """libc's ``madvise``, or None off Linux (where ``MADV_DONTNEED`` has other meanings)."""
    if not sys.platform.startswith("linux"):
        return None
    function = ctypes.CDLL(None, use_errno=True).madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def _interior(start: int, end: int) -> tuple[int, int]:
    """The page-aligned part of the byte range ``[start, end)``: ``(first, last)``, empty when ``first >= last``."""
    page = mmap.PAGESIZE
    return -(-start // page) * page, end // page * page


def give_back_pages(start: int, end: int) -> bool:
    """Free the whole pages of the process's byte range ``[start, end)`` (its contents read as zeros afterwards);
    False where nothing could be given back (not Linux, or the kernel refused, e.g. for locked pages)."""
    madvise = _madvise()
    first, last = _interior(start, end)
    if madvise is None or last <= first:
        return False
    return bool(madvise(first, last - first, _MADV_DONTNEED) == 0)


def byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The process's bytes ``[start, end)`` under a contiguous tensor."""
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def zero_without_touching(tensor: torch.Tensor) -> None:
    """``tensor.zero_()`` for a contiguous CPU tensor, with its whole pages given back instead of written: zeros
    that cost no resident memory until written again. Falls back to ``zero_()`` where pages cannot be given back."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
        tensor.zero_()
        return
    start, end = byte_range(tensor)
    first, last = _interior(start, end)
    if last <= first or not give_back_pages(start, end):
        tensor.zero_()
        return
    flat = tensor.view(-1)
    size = tensor.element_size()
    flat.narrow(0, 0, -(-(first - start) // size)).zero_()  # the partial pages at both ends
    tail = (last - start) // size
    flat.narrow(0, tail, flat.numel() - tail).zero_()
