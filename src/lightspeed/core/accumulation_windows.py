"""Window arithmetic for gradient accumulation: which micro-batch closes a window, and how big each window really is.

``accumulate`` micro-batches make one optimizer step (one *window*). When the number of batches in a pass over the
data is not a multiple of ``accumulate``, the last window of the pass is short. Frameworks that divide every
micro-batch loss by ``accumulate`` then under-weight that window by ``k / accumulate``; :meth:`loss_scale` gives the
factor that repairs a loss that was already divided that way.

Two ways to cut windows:

* ``sync_with_dataloader=True`` (default): windows restart with every pass over the dataloader; the last one of a pass
  may be short and still steps.
* ``sync_with_dataloader=False``: windows run over the concatenated stream of passes, so every window holds exactly
  ``accumulate`` micro-batches; micro-batches left at the end of a pass join the next pass's first window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AccumulationWindows:
    """Boundaries and real sizes of accumulation windows.

    Args:
        accumulate: micro-batches per optimizer step (``accumulate_grad_batches``).
        num_batches: batches in one pass over the dataloader, or ``None`` when unknown (an iterable dataset without
            ``__len__``); only needed to know in advance that the last window of a pass is short.
        sync_with_dataloader: close the window at the end of every pass (see the module docstring).
    """

    accumulate: int
    num_batches: int | None = None
    sync_with_dataloader: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(
                f"accumulate must be a positive integer (accumulate_grad_batches), got {self.accumulate!r}."
            )
        if self.num_batches is not None and (
            isinstance(self.num_batches, bool) or not isinstance(self.num_batches, int) or self.num_batches < 0
        ):
            raise ValueError(
                f"num_batches must be a non-negative integer, or None when the dataloader has no length; "
                f"got {self.num_batches!r}."
            )

    def _position(self, batch_idx: int, epoch: int) -> int:
        """Index of the micro-batch in the stream the windows are cut from."""
        if batch_idx < 0 or epoch < 0:
            raise ValueError(f"batch_idx and epoch must be non-negative, got batch_idx={batch_idx}, epoch={epoch}.")
        if self.num_batches is not None and batch_idx >= self.num_batches:
            raise ValueError(f"batch_idx {batch_idx} is past the end of a pass of {self.num_batches} batches.")
        if self.sync_with_dataloader or epoch == 0:
            return batch_idx
        if self.num_batches is None:
            raise ValueError(
                "With sync_with_dataloader=False, windows continue across passes, so the number of batches per pass "
                "must be known: pass num_batches."
            )
        return epoch * self.num_batches + batch_idx

    def window_index(self, batch_idx: int, epoch: int = 0) -> int:
        """Index of the window holding micro-batch ``batch_idx`` (counted within the pass when syncing with it)."""
        return self._position(batch_idx, epoch) // self.accumulate

    def opens_window(self, batch_idx: int, epoch: int = 0) -> bool:
        """Whether ``batch_idx`` opens a window (the point where gradients are zeroed)."""
        return self._position(batch_idx, epoch) % self.accumulate == 0

    def window_size(self, batch_idx: int, epoch: int = 0) -> int:
        """Real number of micro-batches in the window holding ``batch_idx``.

        Raises:
            ValueError: when the window may be the short last one of a pass of unknown length.
        """
        position = self._position(batch_idx, epoch)
        if not self.sync_with_dataloader:
            return self.accumulate
        start = position - position % self.accumulate
        if self.num_batches is None:
            raise ValueError(
                "The size of the last window is unknown because the dataloader has no length; count the window's "
                "micro-batches as they arrive (ExactAccumulator does) or pass num_batches."
            )
        return min(self.accumulate, self.num_batches - start)

    def is_boundary(self, batch_idx: int, epoch: int = 0, is_last_batch: bool = False) -> bool:
        """Whether the optimizer steps after micro-batch ``batch_idx``.

        ``is_last_batch`` marks the end of a pass that was only discovered while iterating (no ``num_batches``).
        """
        position = self._position(batch_idx, epoch)
        if (position + 1) % self.accumulate == 0:
            return True
        if not self.sync_with_dataloader:
            return False
        return is_last_batch or (self.num_batches is not None and batch_idx == self.num_batches - 1)

    def loss_scale(self, batch_idx: int, epoch: int = 0) -> float:
        """Factor for a loss already divided by ``accumulate`` so that the window's mean uses its real size ``k``.

        ``(loss / accumulate) * (accumulate / k) == loss / k``.
        """
        return self.accumulate / self.window_size(batch_idx, epoch)

    def steps_per_pass(self) -> int:
        """Optimizer steps in one pass over the dataloader (``sync_with_dataloader=True``)."""
        if self.num_batches is None:
            raise ValueError("The number of steps per pass is unknown because the dataloader has no length.")
        if not self.sync_with_dataloader:
            raise ValueError(
                "With sync_with_dataloader=False windows span passes, so steps differ between passes; "
                "use total_steps(num_passes)."
            )
        return math.ceil(self.num_batches / self.accumulate)

    def total_steps(self, num_passes: int) -> int:
        """Optimizer steps over ``num_passes`` passes (a trailing incomplete window never steps without syncing)."""
        if self.num_batches is None:
            raise ValueError("The number of steps is unknown because the dataloader has no length.")
        if self.sync_with_dataloader:
            return num_passes * self.steps_per_pass()
        return (num_passes * self.num_batches) // self.accumulate
