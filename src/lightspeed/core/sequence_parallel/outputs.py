"""Whole sequences again from the slices an evaluation step returns under sequence parallelism.

Each rank of a group evaluates its slice of every sequence, so per-token predictions and targets (``[batch, slice,
...]``) are gathered over the group along dim 1 and cut back to the batch's length; then the group's first rank holds
what one process would have computed on the whole sequences (the sample gather of ``core/gather`` takes the rows of
each group's first rank only). Per-sample values (``[batch]``) or anything without the slice's positions cannot have
come from the whole sequence and are refused: silently they would be one slice's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightspeed.core.gather.collective import comm_device
from lightspeed.core.gather.tree import flatten

__all__ = ["SliceLayout", "whole_sequences"]


@dataclass(frozen=True)
class SliceLayout:
    """How the last batch was split: ``rows`` sequences of ``length`` positions over the ``size`` ranks of
    ``group``, each holding ``chunk`` consecutive positions (the last one padded)."""

    rows: int
    length: int
    size: int
    group: Any

    @property
    def chunk(self) -> int:
        return -(-self.length // self.size)


def whole_sequences(outputs: Any, layout: SliceLayout | None) -> tuple[Any, str | None]:
    """``outputs`` (a tensor or a nested dict / list / tuple of them, per-token on dim 1) with every slice of the
    group put back in sequence order; or ``(None, problem)`` on every rank of the group when some rank's outputs are
    not per-token slices of the last split batch (a collective in the group: the group's ranks agree first, so one
    rank's problem cannot leave its partners waiting in the gather)."""
    if layout is None:
        return None, "no batch was split by sequence parallelism before the step's outputs arrived"
    leaves, rebuild = flatten(outputs)
    problem = _slice_problem(leaves, layout)
    flag = torch.tensor([int(problem is not None)], device=comm_device())
    flags = [torch.zeros_like(flag) for _ in range(layout.size)]
    dist.all_gather(flags, flag, group=layout.group)
    if problem is not None:
        return None, problem
    if any(int(flag) for flag in flags):
        return None, "another rank of this sequence-parallel group returned outputs that are not per-token slices"
    whole = []
    for leaf in leaves:
        value: torch.Tensor = leaf.value.detach().contiguous()
        parts = [torch.empty_like(value) for _ in range(layout.size)]
        dist.all_gather(parts, value, group=layout.group)
        whole.append(torch.cat(parts, dim=1).narrow(1, 0, layout.length))
    return rebuild(whole), None


def _slice_problem(leaves: list[Any], layout: SliceLayout) -> str | None:
    for leaf in leaves:
        value = leaf.value
        if leaf.kind != "tensor" or value.ndim < 2 or tuple(value.shape[:2]) != (layout.rows, layout.chunk):
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            return (
                f"{leaf.path} is {shape}, and with sequence_parallel_size={layout.size} each rank's step sees "
                f"{layout.chunk} of the {layout.length} positions of its {layout.rows} sequences: return per-token "
                f"predictions and targets of the slice ([{layout.rows}, {layout.chunk}, ...], e.g. "
                "logits.argmax(-1) and batch['shift_labels']), which lightspeed puts back into whole sequences; a "
                "value per sequence computed from a slice would be wrong."
            )
    return None
