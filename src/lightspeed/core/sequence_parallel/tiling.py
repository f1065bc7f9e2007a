"""DeepSpeed's ``TiledMLP`` on the MLP blocks of a HuggingFace causal LM: each MLP runs over slices of the sequence,
so its intermediate activations (``intermediate_size`` wide, usually the widest of a layer) exist for one slice at a
time, at the cost of running the MLP forward once more in the backward pass.

The slice count is ``ceil(sequence / hidden size)``, the largest any rank asks for (under ZeRO-3 every slice gathers
the MLP's weights, a collective, so every rank must cut as many). The blocks are found by class name (``*MLP``:
``LlamaMLP``, ``Qwen2MLP``, ``MistralMLP``, ...); their own ``forward`` is what runs on each slice.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import torch

from lightspeed.core.errors import SequenceParallelError

__all__ = ["tile_mlps"]


def tile_mlps(causal_lm: torch.nn.Module) -> Callable[[], None]:
    """Run every MLP block of ``causal_lm`` tiled; returns the function that undoes it."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    blocks = [module for module in causal_lm.modules() if type(module).__name__.endswith("MLP")]
    if not blocks:
        raise SequenceParallelError(
            f"tiled_mlp=True runs the MLP blocks of the model in slices of the sequence, and "
            f"{type(causal_lm).__name__} has none (no module whose class name ends in 'MLP'): leave tiled_mlp off."
        )
    own = [vars(block).get("forward") for block in blocks]
    for block in blocks:
        block.forward = types.MethodType(_tiled(TiledMLP, type(block).forward), block)

    def undo() -> None:
        for block, forward in zip(blocks, own, strict=True):
            if forward is None:
                vars(block).pop("forward", None)
            else:
                block.forward = forward

    return undo


def _tiled(tiled_mlp: Any, forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def tiled_forward(block: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        shards = torch.tensor(math.ceil(hidden.shape[-2] / hidden.shape[-1]), device=hidden.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(shards, op=torch.distributed.ReduceOp.MAX)
        return tiled_mlp.apply(forward, block, hidden, int(shards), list(block.parameters()))

    return tiled_forward
