"""One reading of sizes everywhere: shard sizes, memory budgets."""

from __future__ import annotations

import pytest

from lightspeed.core.common.sizes import parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GB", 2 * 10**9),
        ("2 gb", 2 * 10**9),
        ("500MB", 500 * 10**6),
        ("1GiB", 2**30),
        ("24G", 24 * 2**30),
        ("1.5TB", 1_500_000_000_000),
        ("512MiB", 2**29),
        ("1e3KB", 10**6),
        (4096, 4096),
        (5e9, 5 * 10**9),
    ],
)
def test_sizes(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("16", r"size '16' has no unit: write e.g. '16GB' \(10\^9 bytes\) or '16GiB' \(2\^30 bytes\)"),
        ("2XB", r"Unknown unit 'XB' in size '2XB'"),
        ("lots", r"Cannot read size 'lots'"),
        (0, r"size must be positive, got 0"),
        ("0GB", r"size must be positive, got '0GB'"),
        (1.5, r"not a whole number of bytes"),
        (True, r"must be a size such as 2GB"),
    ],
)
def test_bad_sizes(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_size(value)


def test_caller_error_type_and_name() -> None:
    class MyError(Exception):
        pass

    with pytest.raises(MyError, match=r"--device-memory '80' has no unit"):
        parse_size("80", "--device-memory", MyError)
