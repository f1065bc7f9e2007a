"""The running process's memory, for the benchmarks that measure a step's peak on Linux: its current and peak
resident size (``/proc/self/status``), the reset of the peak (``5`` written to ``/proc/self/clear_refs`` sets
``VmHWM`` back to ``VmRSS``) and the resident part of one tensor."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch

__all__ = ["reset_peak", "resident_bytes", "status_bytes"]


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` size in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    """Make ``VmHWM`` the current resident size, so that it reads the peak from here on."""
    Path("/proc/self/clear_refs").write_text("5")


def resident_bytes(tensor: torch.Tensor) -> int:
    """How many bytes of the whole pages under a CPU tensor are resident (``mincore``): a page given back to the
    system, or never written, is not."""
    page = mmap.PAGESIZE
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    if end <= start:
        return 0
    pages = (end - start) // page
    vector = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if mincore(start, end - start, vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(byte & 1 for byte in vector) * page
