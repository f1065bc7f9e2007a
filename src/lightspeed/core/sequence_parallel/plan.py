"""What a front end asks of sequence parallelism (:class:`SequenceParallel`): the layout checks before any process
starts, the sampler's ranks, the data-parallel size DeepSpeed's batch arithmetic uses, the installation on the model
before its engine is built, each batch's slice and the gradient factor ZeRO-3 needs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightspeed.core.errors import SequenceParallelError
from lightspeed.core.sequence_parallel.agreement import check_same_rows
from lightspeed.core.sequence_parallel.batch import shard_batch
from lightspeed.core.sequence_parallel.logits import tile_logits_loss
from lightspeed.core.sequence_parallel.outputs import SliceLayout, whole_sequences
from lightspeed.core.sequence_parallel.tiling import tile_mlps
from lightspeed.core.sequence_parallel.ulysses import UlyssesInstallation, find_causal_lm

__all__ = ["SequenceParallel"]


class SequenceParallel:
    """Ulysses sequence parallelism over groups of ``size`` consecutive ranks (1: off, every method a no-op), and
    the model's memory savers for long sequences, with or without it: ``tiled_mlp`` (DeepSpeed's ``TiledMLP``) and
    ``tiled_logits_loss`` (the loss over chunks of tokens, :mod:`.logits`: True, or the tokens per chunk).

    The world is ``data-parallel x sequence-parallel``: rank ``r`` is position ``r % size`` of data-parallel group
    ``r // size``; the ranks of one group read the same rows and each trains on its slice of their sequences."""

    def __init__(self, size: int = 1, tiled_mlp: bool = False, tiled_logits_loss: bool | int = False) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise SequenceParallelError(f"sequence_parallel_size must be a whole number >= 1, got {size!r}.")
        if not isinstance(tiled_mlp, bool):
            raise SequenceParallelError(f"tiled_mlp must be True or False, got {tiled_mlp!r}.")
        chunks = tiled_logits_loss
        if not (isinstance(chunks, bool) or (isinstance(chunks, int) and chunks >= 1)):
            raise SequenceParallelError(
                f"tiled_logits_loss must be True, False or the tokens per chunk (a whole number >= 1), got "
                f"{tiled_logits_loss!r}."
            )
        self.size = size
        self.tiled_mlp = tiled_mlp
        self.tiled_logits_loss = tiled_logits_loss
        self._installed: UlyssesInstallation | None = None
        self._untile: list[Callable[[], None]] = []  # undo the tilings, in this order
        self._model: torch.nn.Module | None = None
        self._loss_pending = False  # a batch was split and the model's own loss has not run on it since
        self._layout: SliceLayout | None = None  # how the last batch was split

    @property
    def enabled(self) -> bool:
        """Whether sequences are split (``size > 1``)."""
        return self.size > 1

    # ------------------------------------------------------------------ layout
    def check_world(self, world_size: int) -> None:
        """Refuse a world that does not split into whole groups (before any process starts)."""
        if self.enabled and world_size % self.size:
            raise SequenceParallelError(
                f"sequence_parallel_size={self.size} splits the world into groups of {self.size} ranks, but the run "
                f"has {world_size} process(es): use a number of devices x nodes divisible by {self.size}."
            )

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel groups (distinct rows per step): what DeepSpeed's batch arithmetic counts."""
        return world_size // self.size

    def sampler_kwargs(self, world_size: int, rank: int) -> dict[str, int] | None:
        """``DistributedSampler`` arguments: one replica per data-parallel group, the same rows for its ranks (None
        when off: the front end's own)."""
        if not self.enabled:
            return None
        return {"num_replicas": self.data_parallel_size(world_size), "rank": rank // self.size}

    def check_config(self, stage: int, zero: Mapping[str, Any]) -> None:
        """Refuse ZeRO-3 reduction paths (``zero``: the config's ``zero_optimization`` section) whose gradient
        averaging differs per bucket under sequence parallelism."""
        if not self.enabled or stage != 3:
            return
        off = [key for key in ("reduce_scatter", "contiguous_gradients") if zero.get(key, True) is False]
        if off:
            raise SequenceParallelError(
                f"ZeRO-3 with {', '.join(f'{key}=false' for key in off)} averages some gradient buckets over the "
                "data-parallel groups and others over every rank when sequences are split, and no loss scale makes "
                "both right: leave them at their defaults (true) with sequence_parallel_size > 1."
            )

    def _loss_ran(self) -> None:
        self._loss_pending = False

    def scale_loss(self, loss: torch.Tensor, stage: int) -> torch.Tensor:
        """``loss`` (about to be backpropagated) times :meth:`gradient_factor` (``loss`` itself when the factor is 1).
        A loss that did not come from the model's own loss function on the last split batch is refused: computed from
        a slice's logits and labels by hand, it would be the wrong loss, silently."""
        if self._loss_pending:
            raise SequenceParallelError(
                "The loss given to backward was not computed by the model from the batch lightspeed split: with "
                "sequence_parallel_size > 1 each rank holds a slice of every sequence, with labels already shifted "
                "over the whole sequence, and only the model's own loss (`model(**batch).loss`) adds the slices up to "
                "the loss of whole sequences. Return that loss (scale or add to it as you like)."
            )
        factor = self.gradient_factor(stage)
        return loss * factor if factor != 1.0 else loss

    def gradient_factor(self, stage: int) -> float:
        """What each rank's loss is multiplied by before backward under ZeRO ``stage``: ZeRO-3's reduce-scatter
        averages the gradients over every rank, ZeRO-1/2 over the data-parallel groups (a group's ranks each hold
        part of one gradient)."""
        if self.enabled and stage == 3:
            return float(self.size)
        return 1.0

    # ------------------------------------------------------------------ the model
    def install(self, model: torch.nn.Module, compiled: bool = False) -> Any:
        """Install Ulysses attention and the whole-sequence loss (and the tilings) on ``model`` (a collective: every
        rank, before its engine is built; ``compiled``: the engine will be compiled); returns the ``mpu`` DeepSpeed's
        engine takes (None without sequence parallelism). A refusal leaves the model as it was."""
        if compiled and self.tiled_logits_loss is not False:
            raise SequenceParallelError(
                "tiled_logits_loss replaces the forward of the model and of its output embeddings, which has not been "
                "tested with compilation (compile=True or a torch.compile'd model): leave one of them off."
            )
        if self._model is not model or (self._installed is None and not self._untile):
            self.remove()
            try:
                if self.tiled_mlp:
                    self._untile.append(tile_mlps(find_causal_lm(model)))
                if self.tiled_logits_loss is not False:  # before Ulysses: its whole-sequence loss wraps the tiled one
                    chunk = None if self.tiled_logits_loss is True else int(self.tiled_logits_loss)
                    self._untile.insert(0, tile_logits_loss(find_causal_lm(model), chunk))
                if self.enabled:
                    self._installed = UlyssesInstallation(model, self.size, self._loss_ran)
            except BaseException:
                self.remove()
                raise
            self._model = model
        return self._installed.mpu if self._installed is not None else None

    def remove(self) -> None:
        """Undo :meth:`install` (the front end's teardown); :meth:`shard` installs again if the model runs on."""
        if self._installed is not None:
            self._installed.remove()
            self._installed = None
        while self._untile:
            self._untile.pop(0)()

    # ------------------------------------------------------------------ each batch
    def shard(self, batch: Any) -> Any:
        """This rank's slice of ``batch`` (unchanged when off), once the group's ranks are found to hold the same rows.
        Installs again on the model of the last :meth:`install` when the front end's teardown removed it and the
        engine runs on (evaluation after fit)."""
        if not self.enabled:
            return batch
        if self._installed is None:
            if self._model is None:
                raise SequenceParallelError("a batch was split before the model's engine was built")
            self.install(self._model)
        assert self._installed is not None
        sharded = shard_batch(batch, self._installed.rank, self.size, self._installed.pad_token_id)
        check_same_rows(batch, self._installed.group, self.size)
        self._loss_pending = True
        rows, length = batch["input_ids"].shape
        self._layout = SliceLayout(rows, length, self.size, self._installed.group)
        return sharded

    def whole(self, outputs: Any) -> tuple[Any, str | None]:
        """An evaluation step's per-token ``outputs`` on the last split batch, whole sequences again (a collective in
        the group), or ``(None, why not)`` on every rank of the group: see :func:`.outputs.whole_sequences`."""
        return whole_sequences(outputs, self._layout)
