"""``pad_across_processes``: make tensors whose size differs across ranks the same size, so they can be gathered."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lightspeed.core.common.distributed import is_distributed
from lightspeed.core.gather.collective import CallSite, agree
from lightspeed.core.gather.tree import flatten, nested_problem


def pad_tensor(tensor: torch.Tensor, dim: int, size: int, pad_index: Any = 0, pad_first: bool = False) -> torch.Tensor:
    """Pad ``tensor`` along ``dim`` to ``size`` with ``pad_index`` (at the start when ``pad_first``)."""
    missing = size - tensor.shape[dim]
    if missing < 0:
        raise ValueError(f"cannot pad dim {dim} of size {tensor.shape[dim]} down to {size}")
    if missing == 0:
        return tensor
    dim = dim % tensor.ndim
    # F.pad takes (left, right) pairs starting from the last dimension
    pad = [0, 0] * (tensor.ndim - dim - 1) + ([missing, 0] if pad_first else [0, missing])
    if tensor.dtype == torch.bool:
        return F.pad(tensor.to(torch.uint8), pad, value=int(bool(pad_index))).to(torch.bool)
    return F.pad(tensor, pad, value=pad_index)


def pad_across_processes(data: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad every tensor in ``data`` along ``dim`` to the largest size any rank has there.

    ``data`` may be a tensor or a nested dict/list/tuple of tensors (other leaves come back unchanged, 0-d tensors
    too). ``pad_first=True`` pads at the start (left-padding, e.g. for decoder prompts). Collective: every rank must
    call it with the same structure and number of dimensions. On a single process it returns ``data`` unchanged.

    A ``dim`` that a tensor does not have is an error (on every rank), as is a nested tensor (``torch.nested``):
    convert it with ``.to_padded_tensor(...)`` first.

    Args:
        data: a tensor or a nested dict/list/tuple of tensors.
        dim: the dimension to pad.
        pad_index: the value of the padding.
        pad_first: pad at the start instead of the end.
    """
    if not is_distributed():
        return data
    leaves, rebuild = flatten(data)
    tensors = [leaf for leaf in leaves if leaf.kind == "tensor"]
    error = nested_problem("pad_across_processes", leaves)
    for leaf in tensors if error is None else ():
        if not -leaf.value.ndim <= dim < leaf.value.ndim:
            error = f"dim={dim} is out of range for {leaf.path} with shape {list(leaf.value.shape)}; pass a dim it has."
            break
    sizes, _ = agree(
        "pad_across_processes",
        [leaf.describe() for leaf in leaves] + [f"dim={dim}, pad_first={pad_first}"],
        (CallSite.PAD, 0),
        "pad_across_processes",
        error,
        payload=[leaf.value.shape[dim] if error is None else 0 for leaf in tensors],
    )
    target = [max(rank_sizes[i] for rank_sizes in sizes) for i in range(len(tensors))]
    padded = iter(
        pad_tensor(leaf.value, dim, size, pad_index, pad_first) for leaf, size in zip(tensors, target, strict=True)
    )
    return rebuild([next(padded) if leaf.kind == "tensor" else leaf.value for leaf in leaves])


__all__ = ["pad_across_processes", "pad_tensor"]
