"""The one exception type for every user-facing DeepSpeed config problem."""

from __future__ import annotations

from collections.abc import Sequence


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config (or its combination with the Trainer settings) cannot be used as given.

    The message always says what to change. When several problems were found, all of them are listed so the
    user can fix the config in one go instead of one error per run.
    """


def problems_error(problems: Sequence[str], what: str) -> DeepSpeedConfigError:
    """Build one error from a list of problem lines: the line itself when there is one, else a numbered list."""
    if len(problems) == 1:
        return DeepSpeedConfigError(problems[0])
    lines = "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, start=1))
    return DeepSpeedConfigError(f"{len(problems)} problems {what}:\n{lines}")
