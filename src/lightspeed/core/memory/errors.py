"""The one exception type of the memory planner: every message says what the user should change."""

from __future__ import annotations


class MemoryPlanError(ValueError):
    """Bad input to the planner (counts, sizes, factories) or a machine on which no option fits."""
