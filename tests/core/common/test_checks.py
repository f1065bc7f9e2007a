"""One check of whole-number arguments (dimensions, step counts): ints at or above a minimum, never a bool."""

from __future__ import annotations

import pytest

from lightspeed.core.common.checks import require_whole_number


@pytest.mark.parametrize(("value", "minimum"), [(0, 0), (1, 1), (7, 1)])
def test_whole_numbers_at_or_above_the_minimum_pass_through(value: int, minimum: int) -> None:
    assert require_whole_number(value, minimum, "unused") == value


@pytest.mark.parametrize(("value", "minimum"), [(0, 1), (-1, 0), (True, 0), (False, 0), (1.0, 0), ("2", 0), (None, 0)])
def test_anything_else_raises_the_message_given(value: object, minimum: int) -> None:
    with pytest.raises(ValueError, match="^steps must be a whole number$"):
        require_whole_number(value, minimum, "steps must be a whole number")
