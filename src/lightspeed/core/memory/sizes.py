"""Byte sizes for the memory planner: reading budgets (through lightspeed's one size parser,
:func:`lightspeed.core.sizes.parse_size`) and formatting estimates for tables and messages."""

from __future__ import annotations

from lightspeed.core.memory.errors import MemoryPlanError
from lightspeed.core.sizes import parse_size as _parse_size

GIB = 2**30


def parse_size(value: int | float | str, what: str = "size") -> int:
    """Bytes from ``"80GB"`` (10^9), ``"80GiB"``/``"80G"`` (2^30) or an ``int`` number of bytes; text without a
    unit (``"16"``) is refused. Errors are :class:`MemoryPlanError` naming ``what`` (e.g. ``"--gpu-memory"``)."""
    return _parse_size(value, what, MemoryPlanError)


def parse_count(text: str | int | float, what: str) -> int:
    """A positive parameter count from ``7e9``, ``"1.3e8"`` or ``"125000000"``."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise MemoryPlanError(f"{what} must be a number such as 7e9, got {text!r}.") from None
    if not value > 0 or value != value or value == float("inf"):
        raise MemoryPlanError(f"{what} must be a positive number, got {text!r}.")
    return int(round(value))


def format_gib(num_bytes: float) -> str:
    """Bytes as GiB with two decimals (DeepSpeed's estimators print 2^30 bytes as "GB" the same way)."""
    return f"{num_bytes / GIB:.2f}"


def table_unit(largest: float) -> tuple[str, int]:
    """The unit (name, bytes) a table of sizes up to ``largest`` bytes is readable in: GiB, else MiB, else KiB."""
    for name, size in (("GiB", GIB), ("MiB", 2**20)):
        if largest >= size:
            return name, size
    return "KiB", 2**10


def format_size(num_bytes: float) -> str:
    """Bytes with a unit that keeps two meaningful decimals: ``"12.50 GiB"``, ``"830.00 KiB"``."""
    name, size = table_unit(num_bytes)
    return f"{num_bytes / size:.2f} {name}"


def format_short(num_bytes: float) -> str:
    """Bytes in at most 7 characters for table cells: ``"13.04G"``, ``"830.0M"``, ``"27.7K"``, ``"0"``."""
    if num_bytes == 0:
        return "0"
    for suffix, size in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if num_bytes >= size:
            value = num_bytes / size
            return (
                f"{value:.2f}{suffix}"
                if value < 100
                else f"{value:.1f}{suffix}"
                if value < 1000
                else f"{value:.0f}{suffix}"
            )
    return f"{int(num_bytes)}B"
