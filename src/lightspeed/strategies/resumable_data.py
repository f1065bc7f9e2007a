"""Make the training dataloader of a run resumable mid-epoch (the strategies' ``process_dataloader`` hook).

Lightning saves the ``state_dict()`` of a training dataloader that has one in every checkpoint and restores it
before iterating on resume. A plain ``DataLoader`` has none, so Lightning restarts the interrupted epoch from its
first batch and samples are seen twice. lightspeed swaps the ``DistributedSampler`` Lightning injects for a
:class:`~lightspeed.core.reliability.resumable_sampler.ResumableDistributedSampler` (the same order) and gives the
loader its ``state_dict``/``load_state_dict``. Loaders that are already stateful, or carry a sampler of their own or
a custom batch sampler, are left as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightspeed.core.reliability.last_checkpoint import describe_skipped, incomplete_checkpoints
from lightspeed.core.reliability.resumable_sampler import ResumableDistributedSampler
from lightspeed.strategies.mixin_bases import StrategyBase

if TYPE_CHECKING:
    import lightning.pytorch as pl


__all__ = ["ResumableDataMixin", "make_resumable", "warn_about_skipped_checkpoints"]


class ResumableDataMixin(StrategyBase):
    """Resumable training dataloaders (:func:`make_resumable`) and, for a fit that starts fresh, a warning about the
    incomplete checkpoints ``ckpt_path="last"`` skipped; mix in before a Lightning strategy."""

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        return make_resumable(getattr(module, "_trainer", None), dataloader)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is not None and trainer.ckpt_path is None and trainer.is_global_zero:
            warn_about_skipped_checkpoints(trainer)


def make_resumable(trainer: pl.Trainer | None, dataloader: object) -> object:
    """The training ``dataloader`` with a resumable sampler and ``state_dict``; anything else unchanged."""
    if trainer is None or trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
        return dataloader
    sampler = dataloader.sampler
    if type(sampler) is not DistributedSampler or dataloader.batch_size is None or isinstance(dataloader, _Stateful):
        return dataloader
    progress = trainer.fit_loop.epoch_loop.batch_progress
    resumable = ResumableDistributedSampler.replacing(
        sampler, dataloader.batch_size, consumed_batches=lambda: progress.current.ready
    )
    loader = _update_dataloader(dataloader, resumable, mode=RunningStage.TRAINING)
    loader.state_dict = resumable.state_dict
    loader.load_state_dict = resumable.load_state_dict
    return loader


def warn_about_skipped_checkpoints(trainer: pl.Trainer) -> None:
    """A fit that starts fresh: warn about the incomplete checkpoints (interrupted saves) in the checkpoint
    directories, which ``ckpt_path="last"`` skipped."""
    leftovers = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            leftovers += incomplete_checkpoints(callback.dirpath)
    if leftovers:
        rank_zero_warn(
            f"lightspeed: training starts fresh; skipped {len(leftovers)} incomplete checkpoint(s): "
            f"{describe_skipped(leftovers)}."
        )
