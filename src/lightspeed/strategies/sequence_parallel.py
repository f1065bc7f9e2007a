"""The Trainer's side of sequence parallelism (``ZeroStrategy(sequence_parallel_size=N)``): the session's
:class:`~lightspeed.core.sequence_parallel.SequenceParallel` asked at Lightning's three places: the sampler's ranks,
each batch after its transfer to the device, and the loss before backward."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightspeed.strategies.mixin_bases import DeepSpeedStrategyBase

if TYPE_CHECKING:
    import torch

    from lightspeed.core.zero.session import ZeroSession

__all__ = ["SequenceParallelMixin"]


class SequenceParallelMixin(DeepSpeedStrategyBase):
    """Sequence parallelism for the ZeRO strategy whose run is ``self._session``; mix in before Lightning's class."""

    _session: ZeroSession

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        return self._session.sequence_parallel.shard(super().batch_to_device(batch, device, dataloader_idx))

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        closure_loss = self._session.scale_loss(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        own = self._session.sequence_parallel.sampler_kwargs(self.world_size, self.global_rank)
        return own or super().distributed_sampler_kwargs
