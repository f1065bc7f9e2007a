"""Process-group facts, and the one way lightspeed turns a failure on some ranks into an error on every rank.

A rank that raises on its own leaves the others waiting in their next collective until a timeout, if there is one.
Code that can fail on some ranks only (a full disk while staging a checkpoint, a non-empty export directory seen
by rank 0) runs its step, then calls :func:`raise_on_every_rank`: one small collective after which every rank
raises, or none does.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["global_rank", "is_distributed", "raise_on_every_rank", "values_by_rank"]


def is_distributed() -> bool:
    """True when a process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def global_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return dist.get_rank() if is_distributed() else 0


def values_by_rank(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order (a collective: every rank must call it); ``[value]`` without
    a process group of several ranks."""
    if not is_distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def raise_on_every_rank(
    error: BaseException | None,
    what: str,
    *,
    error_type: type[Exception] = RuntimeError,
    others_message: str | None = None,
) -> None:
    """Agree on ``error`` across ranks (a collective: every rank must call it, with or without an error).

    Returns on every rank when no rank passed an error. Otherwise every rank raises: a rank that passed an error
    raises it as it is; the others raise ``error_type`` with ``others_message`` when given, else with the first
    failing rank's message (``"<what> failed on rank R: <message>"`` when several ranks may fail, which the caller
    says by passing ``others_message``; a check made on one rank only reads best with its own message, so that is
    passed through unchanged). Without a process group ``error`` is raised as it is.
    """
    if not is_distributed():
        if error is not None:
            raise error
        return
    reports: list[str | None] = values_by_rank(None if error is None else str(error))
    failed = [rank for rank, report in enumerate(reports) if report is not None]
    if not failed:
        return
    if error is not None:
        raise error
    if others_message is not None:
        raise error_type(others_message)
    if len(failed) == 1:
        raise error_type(reports[failed[0]])
    raise error_type(f"{what} failed on ranks {', '.join(map(str, failed))}: {reports[failed[0]]}")
