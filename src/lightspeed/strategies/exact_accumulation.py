"""Exact gradient accumulation for any Lightning strategy, as a mixin placed before the Lightning base class.

Lightning's automatic optimization divides every micro-batch loss by ``accumulate_grad_batches`` (``N``), steps on
every ``N``-th micro-batch or the last one of the epoch, and runs the other micro-batches under
``strategy.block_backward_sync()``. The mixin keeps that loop (so ``optimizer_step``, ``on_before_optimizer_step``,
``optimizer_zero_grad`` and ``interval="step"`` schedulers run once per real step) and changes three strategy hooks:

* ``training_step``: checks the loss is a scalar, reads ``num_items`` from a returned dict (else counts the batch's
  samples) and records the micro-batch in a :class:`~lightspeed.core.accumulation.exact.ExactAccumulator`;
* ``backward``: multiplies the ``N``-normalised loss back to a sum over items (``N`` for a summed loss, ``N * b`` for
  a mean over ``b`` samples);
* ``optimizer_step``: after the boundary micro-batch's backward (gradients synced), all-reduces the window's item
  count once and multiplies the gradients by ``W / T`` before ``on_before_optimizer_step`` and clipping see them.
  Strategies that know the configured micro-batch size (:meth:`_exact_micro_batch_size`, the ZeRO family) weigh each
  micro-batch relative to the window's expected samples instead (its micro-batches, fewer for an epoch's known short
  last window, times that size), so a window of configured micro-batches has the factor 1 and its gradients are
  exact already when backward ends.

The result is the gradient of the mean loss over every item the window saw on every rank (proof in
:mod:`lightspeed.core.accumulation.exact`), for full windows, the short last window of an epoch and uneven items.

Where the data has no length (an ``IterableDataset``) Lightning's prefetching fetcher still learns that a batch is
the last one before running it, so the short last window steps at the epoch end and its gradient is scaled at step
time by the items it really saw; nothing needs the window size in advance. With a ``training_step`` that takes a
``dataloader_iter``, the end is only seen at ``StopIteration`` after the last micro-batch: Lightning leaves the epoch
without stepping and that partial window is zeroed at the next window start, as in plain Lightning.

Strategies adapt it through overridable methods: :meth:`_exact_scale_gradients` (where the gradients live),
:meth:`_exact_all_reduce_sum` (the collective), ``_exact_gradients_averaged`` (whether the gradient sync averages
or sums over ranks) and the :meth:`_exact_before_boundary` / :meth:`_exact_after_step` hooks.
:class:`DeepSpeedExactAccumulationMixin` is the version for Lightning's ``DeepSpeedStrategy`` (the ZeRO family).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightspeed.core.accumulation.exact import ExactAccumulator, distributed_sum, scale_gradients
from lightspeed.core.common.batch import count_samples
from lightspeed.core.zero.accumulation import scale_deepspeed_gradients_at_step, set_deepspeed_boundary
from lightspeed.strategies.mixin_bases import DeepSpeedStrategyBase, StrategyBase

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DeepSpeedExactAccumulationMixin", "ExactAccumulationMixin"]


class ExactAccumulationMixin(StrategyBase):
    """Makes ``accumulate_grad_batches`` produce the big-batch gradient; mix in before a Lightning ``Strategy``.

    Args:
        sync_with_dataloader: what the short last window of an epoch does (the one left when the epoch's number of
            batches is not a multiple of ``accumulate_grad_batches``). ``True`` (default): it steps, with its
            gradient scaled to the items it really saw. ``False``: every window must hold exactly
            ``accumulate_grad_batches`` micro-batches, and a short one raises a ``ValueError`` at its step. Either
            way a window never runs on into the next epoch: Lightning's loop steps at the end of every epoch and
            zeroes the gradients at the start of the next.
    """

    _exact_gradients_averaged: bool = True

    def __init__(self, *args: Any, sync_with_dataloader: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sync_with_dataloader = sync_with_dataloader
        self._exact: ExactAccumulator | None = None
        self._exact_multiplier = 1.0
        self._exact_step_active = False  # _exact_active() as the running micro-batch's training_step found it

    # ----------------------------------------------------------------- state
    def _exact_active(self) -> bool:
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return trainer is not None and module is not None and module.automatic_optimization and trainer.training

    def _exact_trainer(self) -> pl.Trainer:
        module = self.lightning_module
        assert module is not None, "exact accumulation runs only while a LightningModule is attached"
        return module.trainer

    @property
    def exact_accumulator(self) -> ExactAccumulator:
        """The accumulator of the running fit (created on first use with this strategy's world size)."""
        if self._exact is None:
            self._exact = ExactAccumulator(
                world_size=getattr(self, "world_size", 1),
                all_reduce_sum=self._exact_all_reduce_sum,
                gradients_averaged=self._exact_gradients_averaged,
                device=self.root_device,
            )
        return self._exact

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._exact = None
        self._exact_multiplier = 1.0

    # ------------------------------------------------------ overridable parts
    def _exact_all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum a small tensor over all ranks, in place; once per window."""
        return distributed_sum(tensor)

    def _exact_scale_gradients(self, optimizer: Optimizer, factor: float) -> None:
        """Multiply the accumulated, synced gradients by ``factor``."""
        scale_gradients((p for group in optimizer.param_groups for p in group["params"]), factor)

    def _exact_micro_batch_size(self) -> int | None:
        """The micro-batch size every rank is configured with, weights are taken relative to (None: plain counts;
        the factor is then applied to every window)."""
        return None

    # ------------------------------------------------------------ the hooks
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._exact_step_active = self._exact_active()  # once per micro-batch: its backward reads the flag
        output = super().training_step(*args, **kwargs)
        if self._exact_step_active:
            batch = args[0] if args else kwargs.get("batch")
            self._exact_record(output, batch)
        return output

    def _exact_record(self, output: Any, batch: Any) -> None:
        trainer = self._exact_trainer()
        accumulate = trainer.accumulate_grad_batches
        accumulator = self.exact_accumulator
        if trainer.fit_loop.epoch_loop.batch_idx % accumulate == 0:
            accumulator.start_window()  # the same rule Lightning uses to zero gradients
        self._exact_multiplier = 1.0
        if isinstance(output, Mapping):
            loss, num_items = output.get("loss"), output.get("num_items")
        else:
            loss, num_items = output, None
        if loss is None:
            return  # skipped step; Lightning reports a dict without "loss" itself
        num_samples = count_samples(batch) if num_items is None else None
        micro_batch = self._exact_micro_batch_size()
        window_items = self._exact_window_length(trainer) * micro_batch if micro_batch else None
        self._exact_multiplier = accumulator.record(
            loss, num_items, num_samples, normalized_by=accumulate, window_items=window_items
        )

    @staticmethod
    def _exact_window_length(trainer: pl.Trainer) -> int:
        """Micro-batches the current window holds: ``accumulate_grad_batches``, fewer for the short last window of an
        epoch whose length is known (the same on every rank)."""
        accumulate = trainer.accumulate_grad_batches
        batches = trainer.num_training_batches
        if not isinstance(batches, int):  # inf: an iterable without length; its short window gets its factor
            return accumulate
        start = trainer.fit_loop.epoch_loop.batch_idx // accumulate * accumulate
        return max(1, min(accumulate, batches - start))

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._exact_step_active and self._exact_multiplier != 1.0:
            closure_loss = closure_loss * self._exact_multiplier
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if not self._exact_active():
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_exact_scale() -> Any:
            result = closure()
            self._exact_finish_window(optimizer)
            return result

        self._exact_before_boundary()
        try:
            return super().optimizer_step(optimizer, closure_then_exact_scale, model, **kwargs)
        finally:
            self._exact_after_step()

    def _exact_before_boundary(self) -> None:
        """Runs before the boundary micro-batch's training_step and backward (hook for engines that must know)."""

    def _exact_after_step(self) -> None:
        """Runs after the optimizer step (hook to undo what :meth:`_exact_scale_gradients` set up for the step)."""

    def _exact_finish_window(self, optimizer: Optimizer) -> float:
        """Close the window: check its size, all-reduce its counts once, scale the gradients; returns the factor."""
        accumulator = self.exact_accumulator
        trainer = self._exact_trainer()
        accumulate = trainer.accumulate_grad_batches
        if not self.sync_with_dataloader and accumulator.micro_batches != accumulate:
            raise ValueError(
                f"The accumulation window ending at batch {trainer.fit_loop.epoch_loop.batch_idx} of epoch "
                f"{trainer.current_epoch} holds {accumulator.micro_batches} of accumulate_grad_batches={accumulate} "
                f"micro-batches, but sync_with_dataloader=False requires full windows. Make the number of batches per "
                f"epoch a multiple of {accumulate}, or pass sync_with_dataloader=True to step the short window "
                f"with its gradient scaled to its real size."
            )
        factor = accumulator.window_factor()
        self._exact_scale_gradients(optimizer, factor)
        return factor


# ---------------------------------------------------------------------------------------------------------- DeepSpeed
class DeepSpeedExactAccumulationMixin(ExactAccumulationMixin, DeepSpeedStrategyBase):
    """Exact accumulation for Lightning's ``DeepSpeedStrategy`` subclasses (the ZeRO family); mix in first.

    * Lightning's loop owns accumulation (``handles_gradient_accumulation`` is ``False``), so ``optimizer_step``,
      ``on_before_optimizer_step``, ``optimizer_zero_grad`` and step schedulers run once per real step, and the
      short last window of an epoch steps instead of leaking into the next epoch.
    * The engine is told each micro-batch's role (:func:`set_deepspeed_boundary`): non-boundary micro-batches run
      in ``block_backward_sync`` with the boundary off, so ZeRO-1 does not reduce them; ZeRO-2/3 reduce-scatter
      every micro-batch by DeepSpeed's design (each rank keeps only its gradient partition).
    * ``engine.backward`` runs with ``scale_wrt_gas=False``: the mixin does the weighting itself.
    * The window factor ``W / T`` (exactly 1 for a full window of configured micro-batches: nothing to do) is
      multiplied into the reduced gradients where ZeRO keeps them, before ``on_before_optimizer_step``
      (:func:`scale_deepspeed_gradients_at_step`).
    """

    _exact_restore: Callable[[], None] | None = None

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        return False

    def _engines_in_window(self) -> list[Any]:
        """The engines whose accumulation window the loop drives (one per trained model)."""
        return [self.model]

    def _engine_stepping(self, optimizer: Optimizer) -> Any:
        """The engine that steps ``optimizer``."""
        return self.model

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        for engine in self._engines_in_window():
            set_deepspeed_boundary(engine, False)
        yield

    @override
    def _exact_before_boundary(self) -> None:
        for engine in self._engines_in_window():
            set_deepspeed_boundary(engine, True)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._exact_step_active:
            kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def _exact_micro_batch_size(self) -> int | None:
        # the resolved config's, the same on every rank: full windows of such micro-batches need no factor, so the
        # partitioned gradients are right when backward ends and DeepSpeed's step does not rescale them
        size = self._engines_in_window()[0].train_micro_batch_size_per_gpu()
        return size if isinstance(size, int) and size > 0 else None

    @override
    def _exact_scale_gradients(self, optimizer: Optimizer, factor: float) -> None:
        self._exact_restore = scale_deepspeed_gradients_at_step(self._engine_stepping(optimizer), factor)

    @override
    def _exact_after_step(self) -> None:
        if self._exact_restore is not None:
            self._exact_restore()
            self._exact_restore = None
