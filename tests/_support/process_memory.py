"""The running process's memory, for the benchmarks that measure a step's peak on Linux: its current and peak
resident size (``/proc/self/status``) and the reset of the peak (``5`` written to ``/proc/self/clear_refs`` sets
``VmHWM`` back to ``VmRSS``)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["reset_peak", "status_bytes"]


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` size in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    """Make ``VmHWM`` the current resident size, so that it reads the peak from here on."""
    Path("/proc/self/clear_refs").write_text("5")
