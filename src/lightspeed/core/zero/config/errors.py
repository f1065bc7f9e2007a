"""The one exception type for every user-facing DeepSpeed config problem."""

from __future__ import annotations

from collections.abc import Sequence

from lightspeed.core.errors import DeepSpeedConfigError


def problems_error(problems: Sequence[str], what: str) -> DeepSpeedConfigError:
    """Build one error from a list of problem lines: the line itself when there is one, else a numbered list."""
    if len(problems) == 1:
        return DeepSpeedConfigError(problems[0])
    lines = "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, start=1))
    return DeepSpeedConfigError(f"{len(problems)} problems {what}:\n{lines}")
