"""Exact gradient accumulation for hand-written Fabric loops, with Accelerate's ``accumulate()`` semantics.

::

    for batch, step in lightspeed.fabric.accumulate(fabric, model, loader, steps=4):
        loss = loss_fn(model(batch["x"]), batch["y"])      # the micro-batch's mean loss, as in a plain loop
        step.backward(loss)                                 # instead of fabric.backward(loss)
        if step.sync_gradients:                             # the window's last micro-batch
            fabric.clip_gradients(model, optimizer, max_norm=1.0)   # optional
            optimizer.step()
            optimizer.zero_grad()

What it does (the arithmetic is :class:`~lightspeed.core.accumulation.exact.ExactAccumulator`, shared with the Trainer):

* windows of ``steps`` micro-batches; the epoch's last micro-batch always closes a window (seen one batch ahead, so
  loaders without a length work too), so a short last window steps with its own size: a 10-batch epoch with
  ``steps=4`` steps 3 times, the last window weighted 2/2, not 2/4;
* each window's gradient is the gradient of the mean loss over every sample the window saw on every rank;
  ``step.backward(loss_sum, num_items=n)`` weights by items instead (a summed loss over ``n`` tokens): the result is
  the mean over all tokens of the window on all ranks;
* no gradient all-reduce on non-boundary micro-batches under DDP (``ddp``, ``ddp_exact``: the forward and the
  backward run in ``fabric.no_backward_sync``); under ZeRO the engine is told which micro-batch closes the window
  (ZeRO-1 reduces only then; ZeRO-2/3 reduce-scatter every micro-batch by DeepSpeed's design);
* the window's factor ``W / T`` (ranks over items) is applied after the boundary backward: to ``.grad`` under DDP,
  inside the ZeRO optimizer's next step (before clipping) under lightspeed's ZeRO strategies.

Every rank must see the same number of micro-batches per epoch (``fabric.setup_dataloaders`` does this).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DeepSpeedStrategy, SingleDeviceStrategy
from lightning.fabric.wrappers import _FabricModule
from torch import Tensor

from lightspeed.core.accumulation.exact import ExactAccumulator, scale_gradients
from lightspeed.core.common.batch import count_samples
from lightspeed.core.zero.accumulation import set_deepspeed_accumulation_steps, set_deepspeed_boundary
from lightspeed.fabric.zero import ZeroFabricStrategy

__all__ = ["AccumulationStep", "accumulate"]


class AccumulationStep:
    """One micro-batch of :func:`accumulate`: run its loss through :meth:`backward`; step the optimizer when
    :attr:`sync_gradients` is True.

    Attributes:
        index: the micro-batch's position in the loader (0-based).
        window: the accumulation window's number in this pass over the loader (0-based).
        position: the micro-batch's position in its window (0-based).
        sync_gradients: True on the window's last micro-batch (Accelerate's name): gradients are complete after its
            backward, so clip, ``optimizer.step()`` and ``optimizer.zero_grad()`` then.
    """

    def __init__(self, driver: _Driver, batch: Any, index: int, window: int, position: int, boundary: bool) -> None:
        self._driver = driver
        self._batch = batch
        self.index = index
        self.window = window
        self.position = position
        self.sync_gradients = boundary
        self.backward_done = False
        self.factor: float | None = None  # the window factor W / T, set by the boundary's backward

    def backward(self, loss: Tensor, num_items: int | float | Tensor | None = None) -> None:
        """``fabric.backward`` for this micro-batch, weighted so that the window's gradient is exact.

        Args:
            loss: the micro-batch's loss: its mean over samples, or with ``num_items`` its sum over items.
            num_items: the number of items (tokens, ...) the summed ``loss`` covers; give it for every micro-batch
                of a window or for none.
        """
        self._driver.backward(self, loss, num_items)

    def __repr__(self) -> str:
        return (
            f"AccumulationStep(index={self.index}, window={self.window}, position={self.position}, "
            f"sync_gradients={self.sync_gradients})"
        )


class _Driver:
    """What :func:`accumulate` does for one strategy family: sync control, backward, window factor."""

    def __init__(self, fabric: Fabric, model: Any, steps: int) -> None:
        self.fabric = fabric
        self.model = model
        self.steps = steps
        strategy = fabric.strategy
        if isinstance(strategy, DeepSpeedStrategy) and not isinstance(strategy, ZeroFabricStrategy):
            raise TypeError(
                f"lightspeed.fabric.accumulate needs lightspeed's ZeRO strategies for DeepSpeed, but Fabric runs "
                f"Lightning's {type(strategy).__name__}. Use Fabric(strategy='zero2') (or zero1, zero3, ...): they "
                "take the same DeepSpeed config."
            )
        self.zero = strategy if isinstance(strategy, ZeroFabricStrategy) else None
        self.skips_sync = not isinstance(strategy, SingleDeviceStrategy) and strategy._backward_sync_control is not None
        self.accumulator = ExactAccumulator(world_size=fabric.world_size, gradients_averaged=True, device=fabric.device)
        self._saved_steps: int | None = None

    @property
    def engine(self) -> Any:
        """The engine of the model being accumulated (with several models, not the last one set up)."""
        assert self.zero is not None
        return self.zero._engine_for(getattr(self.model, "_forward_module", None))

    def begin(self) -> None:
        if self.zero is None:
            return
        if self.engine is None:
            raise RuntimeError("Set up the model first: `model, optimizer = fabric.setup(model, optimizer)`.")
        configured = self.zero.accumulation_steps_in_config
        if configured is not None and configured != self.steps:
            raise ValueError(
                f"gradient_accumulation_steps={configured} in the DeepSpeed config, but "
                f'lightspeed.fabric.accumulate(steps={self.steps}). Make them agree, or set it to "auto" (or remove '
                "it): the helper then tells DeepSpeed the window size itself."
            )
        self._saved_steps = self.engine.gradient_accumulation_steps()
        set_deepspeed_accumulation_steps(self.engine, self.steps)

    def end(self) -> None:
        if self.zero is not None and self._saved_steps is not None and self.engine is not None:
            set_deepspeed_accumulation_steps(self.engine, self._saved_steps)
            self._saved_steps = None

    def micro_batch(self, step: AccumulationStep) -> AbstractContextManager:
        """The context the micro-batch's forward and backward run in."""
        if step.position == 0:
            if self.zero is not None and self.zero.step_pending:
                raise RuntimeError(
                    "The previous accumulation window ended without `optimizer.step()`: step the optimizer when "
                    "`step.sync_gradients` is True (its gradient factor is waiting for that step)."
                )
            self.accumulator.start_window()
        if self.zero is not None:
            set_deepspeed_boundary(self.engine, step.sync_gradients)
            return nullcontext()
        if self.skips_sync:
            return self.fabric.no_backward_sync(self.model, enabled=not step.sync_gradients)
        return nullcontext()

    def backward(self, step: AccumulationStep, loss: Tensor, num_items: int | float | Tensor | None) -> None:
        if step.backward_done:
            raise RuntimeError(f"step.backward was already called for micro-batch {step.index}; call it once.")
        num_samples = count_samples(step._batch) if num_items is None else None
        multiplier = self.accumulator.record(loss, num_items, num_samples)
        weighted = loss * multiplier if multiplier != 1.0 else loss
        if self.zero is not None:
            # the engine must not divide by its accumulation count: the weights above are exact already
            self.fabric.backward(weighted, model=self.model, scale_wrt_gas=False)
        else:
            self.fabric.backward(weighted, model=self.model)
        step.backward_done = True
        if step.sync_gradients:
            factor = self.accumulator.window_factor()
            step.factor = factor
            if self.zero is not None:
                self.zero.scale_next_step(factor, self.engine)
            else:
                scale_gradients(self.model.parameters(), factor)

    def after(self, step: AccumulationStep) -> None:
        if step.sync_gradients and not step.backward_done:
            raise RuntimeError(
                f"Micro-batch {step.index} closes an accumulation window, but step.backward(loss) was not called for "
                "it. Call step.backward(loss) on every micro-batch (at least on those with step.sync_gradients)."
            )


def _check_steps(steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"accumulate(steps=...) is the number of micro-batches per optimizer step, >= 1; got {steps!r}."
        )
    return steps


def accumulate(
    fabric: Fabric, model: torch.nn.Module, dataloader: Iterable[Any], steps: int
) -> Iterator[tuple[Any, AccumulationStep]]:
    """Iterate over ``dataloader`` in accumulation windows of ``steps`` micro-batches, yielding ``(batch, step)``.

    Call ``step.backward(loss)`` for every micro-batch (forward inside the loop body) and step the optimizer when
    ``step.sync_gradients`` is True; see the module docstring for the guarantees. ``model`` is what
    ``fabric.setup`` returned. Use it once per epoch: a window never runs on into the next pass over the loader.

    Args:
        fabric: the launched ``Fabric``.
        model: the model ``fabric.setup`` returned (under several models: the one the loss trains).
        dataloader: the training dataloader, set up with ``fabric.setup_dataloaders`` (a short last window is
            stepped with its real size when it has ``len()``).
        steps: micro-batches per optimizer step (the accumulation window).
    """
    _check_steps(steps)
    driver = _Driver(fabric, model, steps)
    if not isinstance(model, _FabricModule):
        raise TypeError(
            "lightspeed.fabric.accumulate needs the model returned by fabric.setup: "
            "`model, optimizer = fabric.setup(model, optimizer)`."
        )
    return _windows(driver, dataloader, steps)


def _windows(driver: _Driver, dataloader: Iterable[Any], steps: int) -> Generator[tuple[Any, AccumulationStep]]:
    iterator = iter(dataloader)
    try:
        upcoming = next(iterator)
    except StopIteration:
        return
    driver.begin()
    try:
        index, window, position = 0, 0, 0
        while True:
            batch = upcoming
            try:
                upcoming = next(iterator)
                last = False
            except StopIteration:
                last = True
            step = AccumulationStep(driver, batch, index, window, position, boundary=last or position == steps - 1)
            with driver.micro_batch(step):
                yield batch, step
            driver.after(step)
            if last:
                return
            index += 1
            if step.sync_gradients:
                window, position = window + 1, 0
            else:
                position += 1
    finally:
        driver.end()
