"""The one wording of a key mismatch between a module and stored weights (exports and ZeRO checkpoints)."""

from __future__ import annotations

import pytest

from lightspeed.core.checkpoint.loading import describe_key_mismatch

LABELS = ("missing from the checkpoint", "not in the model")


@pytest.mark.parametrize(
    ("missing", "unexpected", "expected"),
    [
        (["a"], [], "missing from the checkpoint: a"),
        ([], ["x", "y"], "not in the model: x, y"),
        (["a", "b"], ["x"], "missing from the checkpoint: a, b; not in the model: x"),
        ([], [], ""),
    ],
)
def test_each_non_empty_group_is_labelled_missing_first(
    missing: list[str], unexpected: list[str], expected: str
) -> None:
    assert describe_key_mismatch(missing, unexpected, LABELS, ", ".join) == expected


def test_the_caller_chooses_how_a_list_of_keys_is_written() -> None:
    assert (
        describe_key_mismatch(["a"], ["x"], LABELS, str)
        == "missing from the checkpoint: ['a']; not in the model: ['x']"
    )
