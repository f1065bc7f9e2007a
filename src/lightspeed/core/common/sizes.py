"""Byte sizes written by people: one parser for shard sizes, memory budgets and every other size lightspeed reads,
and the formatting of sizes for tables and messages.

``"2GB"`` is 2·10^9 bytes (the convention of ``max_shard_size`` in HF and safetensors), ``"2GiB"`` and ``"2G"``
are 2·2^30 (binary, as ``free``/``nvidia-smi`` print), ``"512MB"``, ``"1.5TB"``. A Python ``int`` (or a whole
``float`` such as ``5e9``) is a number of bytes. A number written as text needs a unit: ``"16"`` could mean bytes
or GiB, so it is refused with a message that shows both spellings.
"""

from __future__ import annotations

import re

GIB = 2**30

UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, what: str = "size", error: type[Exception] = ValueError) -> int:
    """Bytes from ``value``; raises ``error`` (the caller's user-facing exception type) naming ``what``."""
    if isinstance(value, bool):
        raise error(f"{what} must be a size such as 2GB, got {value!r}.")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not value.is_integer():
            raise error(f"{what} {value!r} is not a whole number of bytes; write it with a unit, e.g. '1.5GB'.")
        size = int(value)
    else:
        match = _SIZE.match(str(value))
        if match is None:
            raise error(f"Cannot read {what} {value!r}: write a number with a unit, e.g. 2GB, 500MB or 24GiB.")
        number, unit = float(match.group(1)), match.group(2).lower()
        if not unit:
            raise error(
                f"{what} {value!r} has no unit: write e.g. '{match.group(1)}GB' (10^9 bytes) or "
                f"'{match.group(1)}GiB' (2^30 bytes)."
            )
        if unit not in UNITS:
            raise error(
                f"Unknown unit {match.group(2)!r} in {what} {value!r}: use B, KB, MB, GB, TB (powers of 10) or KiB, "
                "MiB, GiB, TiB (powers of 2)."
            )
        size = int(number * UNITS[unit])
    if size <= 0:
        raise error(f"{what} must be positive, got {value!r}.")
    return size


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
