"""The causal-LM loss of a model trained with sequence parallelism: each rank's summed loss over its slice divided by
the real targets of the whole micro-batch (:func:`~lightspeed.core.sequence_parallel.batch.shard_batch` passes both),
so the gradients of the group's ranks add up to the gradient of the micro-batch's token mean. Its value is that whole
mean on every rank of the group (one small all-reduce), so logs and the loss a step returns are what one process
would report."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightspeed.core.errors import SequenceParallelError

__all__ = ["sequence_parallel_loss"]

LossFunction = Callable[..., torch.Tensor]


def sequence_parallel_loss(original: LossFunction, group: Any, computed: Callable[[], None]) -> LossFunction:
    """``original`` (a HuggingFace ``loss_function``) made whole over the sequence-parallel ``group``; ``computed``
    is called each time it runs."""

    def loss_function(
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None or num_items_in_batch is None:
            raise SequenceParallelError(
                "This model trains with sequence parallelism: call it with the whole batch lightspeed gives the step "
                "(`model(**batch)`: its slice of input_ids, position_ids, labels, shift_labels and "
                "num_items_in_batch), not with labels alone; the labels are already shifted over the whole sequence."
            )
        partial = original(
            logits, labels, vocab_size, num_items_in_batch=num_items_in_batch, shift_labels=shift_labels, **kwargs
        )
        whole = partial.detach().clone()
        torch.distributed.all_reduce(whole, group=group)
        computed()
        return partial + (whole - partial.detach())  # the value of the whole, the gradient of this rank's part

    return loss_function
