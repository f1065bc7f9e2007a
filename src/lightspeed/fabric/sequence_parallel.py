"""Fabric's side of sequence parallelism (``ZeroFabricStrategy(sequence_parallel_size=N)``): the session's
:class:`~lightspeed.core.sequence_parallel.SequenceParallel` asked for the sampler's ranks, for each batch of the
loaders ``fabric.setup_dataloaders`` returns, and for the loss before backward."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightspeed.fabric.mixin_bases import DeepSpeedStrategyBase

if TYPE_CHECKING:
    from lightspeed.core.sequence_parallel import SequenceParallel
    from lightspeed.core.zero.session import ZeroSession

__all__ = ["SequenceParallelLoader", "SequenceParallelMixin"]


class SequenceParallelLoader:
    """``loader`` yielding each batch's slice for this rank; every other attribute is the loader's (its sampler for
    Fabric's ``set_epoch``, its length)."""

    def __init__(self, loader: Any, sequence_parallel: SequenceParallel) -> None:
        # the loader's own attributes (its sampler and dataset), as Fabric's loader wrapper copies them from this one
        self.__dict__.update(getattr(loader, "__dict__", {}))
        self._loader = loader
        #: read by ``lightspeed.exact_metrics`` and ``track`` to count a group's rows once and put slices together
        self.lightspeed_sequence_parallel = sequence_parallel

    def __iter__(self) -> Iterator[Any]:
        for batch in self._loader:
            yield self.lightspeed_sequence_parallel.shard(batch)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_loader", "lightspeed_sequence_parallel"):
            raise AttributeError(name)
        return getattr(self._loader, name)


class SequenceParallelMixin(DeepSpeedStrategyBase):
    """Sequence parallelism for the ZeRO Fabric strategy whose run is ``self._session``; mix in before Fabric's
    class."""

    _session: ZeroSession

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)
        if not self._session.sequence_parallel.enabled:
            return dataloader
        return SequenceParallelLoader(dataloader, self._session.sequence_parallel)

    @override
    def backward(self, tensor: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        tensor = self._session.scale_loss(tensor)
        super().backward(tensor, module, *args, **kwargs)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        own = self._session.sequence_parallel.sampler_kwargs(self.world_size, self.global_rank)
        return own or super().distributed_sampler_kwargs
