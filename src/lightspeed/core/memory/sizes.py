"""Parse and format byte sizes, so budgets can be given as ``80GB``, ``24GiB`` or a plain number of GiB."""

from __future__ import annotations

import re

from lightspeed.core.memory.errors import MemoryPlanError

GIB = 2**30

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    # single letters follow DeepSpeed's and nvidia-smi's habit of meaning binary units
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from ``"80GB"`` (10^9), ``"80GiB"``/``"80G"`` (2^30), ``"512MiB"``, a bare number string meaning GiB
    (``"16"``, the command line's shorthand), or an ``int`` that already is a number of bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), "b"
    else:
        match = _SIZE.match(str(text))
        if match is None:
            raise MemoryPlanError(f"Cannot read {what} {text!r}: write a number with an optional unit, e.g. 80GB, 24GiB or 16 (GiB).")
        value, unit = float(match.group(1)), (match.group(2).lower() or "gib")
        if unit not in _UNITS:
            raise MemoryPlanError(f"Unknown unit {match.group(2)!r} in {what} {text!r}: use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.")
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise MemoryPlanError(f"{what} must be positive, got {text!r}.")
    return size


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
            return f"{value:.2f}{suffix}" if value < 100 else f"{value:.1f}{suffix}" if value < 1000 else f"{value:.0f}{suffix}"
    return f"{int(num_bytes)}B"
