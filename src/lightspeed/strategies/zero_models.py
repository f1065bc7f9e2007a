"""The Trainer's ZeRO strategy and the models users bring (:mod:`lightspeed.core.zero.partitioned_build`,
:mod:`lightspeed.core.zero.generation`), as a mixin placed before Lightning's ``DeepSpeedStrategy``:

* ``model_sharded_context`` (around ``configure_model``): transformers knows the ZeRO-3 config, so
  ``AutoModelForCausalLM.from_pretrained(path)`` builds and loads the model straight into partitions, and layers
  deep-copied there (``nn.TransformerEncoder``) are partitioned copies;
* ``init_deepspeed``: every HuggingFace ``generate`` of the module passes ``synced_gpus=True`` while the model is
  partitioned over several ranks, so ranks that stop generating at different steps do not hang;
* ``on_validation_start`` / ``on_test_start`` / ``on_predict_start``: when the ranks' batch counts differ (or are
  unknown), the ZeRO-3 model is gathered once for the evaluation's batches, so a rank that runs out of batches does not
  leave the others waiting in a forward pass (:mod:`lightspeed.core.zero.evaluation`). It is partitioned again before
  the first epoch-end hook of any callback, so that checkpoints and exports made there see the usual partitions.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightspeed.core.zero.evaluation import gathered_for_evaluation
from lightspeed.core.zero.generation import keep_generation_in_step
from lightspeed.core.zero.nvme_swapping import lightspeed_parameter_swapper
from lightspeed.core.zero.partitioned_build import building_into_partitions
from lightspeed.strategies.mixin_bases import DeepSpeedStrategyBase

if TYPE_CHECKING:
    import lightning.pytorch as pl


__all__ = ["ZeroModelsMixin"]


class ZeroModelsMixin(DeepSpeedStrategyBase):
    """Pretrained HuggingFace models built into ZeRO-3 partitions, generation that keeps the ranks in step."""

    config: dict[str, Any]

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        with (
            lightspeed_parameter_swapper(self.config),  # before zero.Init sets up its swapper
            super().model_sharded_context(),
            building_into_partitions(self.config, self.zero_stage_3),
        ):
            yield

    @override
    def init_deepspeed(self) -> None:
        super().init_deepspeed()
        if self.lightning_module is not None:
            keep_generation_in_step(self.lightning_module)

    # ------------------------------------------------------------------ evaluation with uneven batch counts
    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._gather_for_evaluation("validation")

    @override
    def on_validation_end(self) -> None:
        self._partition_after_evaluation()
        super().on_validation_end()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._gather_for_evaluation("test")

    @override
    def on_test_end(self) -> None:
        self._partition_after_evaluation()
        super().on_test_end()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._gather_for_evaluation("predict")

    @override
    def on_predict_end(self) -> None:
        self._partition_after_evaluation()
        super().on_predict_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._partition_after_evaluation()
        super().on_exception(exception)

    def _gather_for_evaluation(self, stage: str) -> None:
        """Gather the ZeRO-3 model for the evaluation's batches when the ranks' batch counts differ or are unknown (a
        collective; see :func:`~lightspeed.core.zero.evaluation.gathered_for_evaluation`)."""
        module = self.lightning_module
        if module is None:
            return
        self._partition_after_evaluation()
        trainer = module.trainer
        stack = ExitStack()
        if not stack.enter_context(gathered_for_evaluation(module, *_batches_to_run(trainer, stage), what=stage)):
            stack.close()  # equal batch counts (or not ZeRO-3): nothing was gathered
            return
        self.__dict__["_evaluation_gather"] = stack
        # no strategy hook runs between the last batch and the callbacks' epoch-end hooks; a callback placed first does
        release = _PartitionAfterTheBatches(self._release_evaluation_gather)
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector
        callbacks.insert(0, release)
        self.__dict__["_evaluation_release"] = (callbacks, release)

    def _release_evaluation_gather(self) -> None:
        """Partition the model gathered for the evaluation again (local: no collective, so safe on any rank alone)."""
        stack = self.__dict__.pop("_evaluation_gather", None)
        if stack is not None:
            stack.close()

    def _partition_after_evaluation(self) -> None:
        self._release_evaluation_gather()
        placed = self.__dict__.pop("_evaluation_release", None)
        if placed is not None:  # removed only here: not while Lightning iterates the callbacks
            callbacks, release = placed
            callbacks[:] = [callback for callback in callbacks if callback is not release]


class _PartitionAfterTheBatches(Callback):
    """Placed first among the Trainer's callbacks during an evaluation whose model was gathered: partitions it again
    when the batches are done, before any other callback's epoch-end hook (a checkpoint or an export made there would
    otherwise meet parameters held whole)."""

    def __init__(self, release: Callable[[], None]) -> None:
        self.release = release

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.release()

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.release()

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.release()


def _batches_to_run(trainer: pl.Trainer, stage: str) -> list[int | float]:
    """How many batches of each dataloader the running evaluation loop runs on this rank (``inf``: unknown)."""
    if stage == "predict":
        return trainer.num_predict_batches
    if stage == "test":
        return trainer.num_test_batches
    return trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
