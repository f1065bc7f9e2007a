"""Byte sizes written by people: one parser for shard sizes, memory budgets and every other size lightspeed reads.

``"2GB"`` is 2·10^9 bytes (the convention of ``max_shard_size`` in HF and safetensors), ``"2GiB"`` and ``"2G"``
are 2·2^30 (binary, as ``free``/``nvidia-smi`` print), ``"512MB"``, ``"1.5TB"``. A Python ``int`` (or a whole
``float`` such as ``5e9``) is a number of bytes. A number written as text needs a unit: ``"16"`` could mean bytes
or GiB, so it is refused with a message that shows both spellings.
"""

from __future__ import annotations

import re

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
