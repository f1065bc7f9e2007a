"""How the Trainer's ZeRO strategy builds its engines: the config resolved from the Trainer and the model, the one
optimizer (and scheduler) of ``configure_optimizers`` made ready for the config, the engine built by the session
(activation checkpointing, compilation), the training engine reused for evaluation after ``fit``, and one engine
per model under ``models=``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.types import LRSchedulerConfig
from typing_extensions import override

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.activation_checkpointing import configure_deepspeed_checkpointing
from lightspeed.core.zero.engine import one_optimizer_error
from lightspeed.core.zero.generation import keep_generation_in_step
from lightspeed.core.zero.parameter_checks import (
    check_parameters_for_zero,
    check_partitions_kept,
    check_same_parameters,
    parameter_ids,
)
from lightspeed.core.zero.release import release_engine
from lightspeed.strategies._training_facts import collect_training_facts
from lightspeed.strategies.several_models import SEVERAL_MODELS_HINT
from lightspeed.strategies.zero_base import ZeroStrategyBase

if TYPE_CHECKING:
    import deepspeed
    import lightning.pytorch as pl

__all__ = ["ZeroEngineMixin"]


class ZeroEngineMixin(ZeroStrategyBase):
    """The engine construction of :class:`~lightspeed.strategies.ZeroStrategy` (its first base)."""

    _train_engine: deepspeed.DeepSpeedEngine | None
    _trained_parameters: tuple[int, ...] = ()  # the parameters the training engine was built with

    # ------------------------------------------------------------------ config resolution
    def _trained_micro_batch(self) -> int | None:
        """The micro-batch size training uses when it is not the training DataLoader's (``zero_auto``'s tuner)."""
        return None

    @override
    def _format_config(self) -> None:
        facts = collect_training_facts(
            self.lightning_module,
            self.world_size,
            self.precision_plugin.precision,
            self.config,
            micro_batch_size=self._trained_micro_batch(),
        )
        self._session.log_config(self._session.resolve(self.config, facts))

    # ------------------------------------------------------------------ engine construction
    def _configured_optimizers(self) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig]]:
        """``configure_optimizers``' optimizers and scheduler configs (it runs once per ``fit``: see
        :meth:`init_deepspeed`)."""
        configured = self.__dict__.pop("_configured", None)
        if configured is not None:
            return configured
        try:
            return _init_optimizers_and_lr_schedulers(self._module())
        except RuntimeError as err:
            # Lightning's own message suggests manual optimization, which does not help under ZeRO either
            if "multiple optimizers" not in str(err):
                raise
            raise one_optimizer_error(
                "several optimizers", "`configure_optimizers` returned", SEVERAL_MODELS_HINT
            ) from None

    @override
    def _init_optimizers(self) -> tuple[torch.optim.Optimizer, LRSchedulerConfig | None]:
        optimizers, schedulers = self._configured_optimizers()
        if len(optimizers) != 1:
            raise one_optimizer_error(
                f"{len(optimizers)} optimizers", "`configure_optimizers` returned", SEVERAL_MODELS_HINT
            )
        if len(schedulers) > 1:
            raise DeepSpeedConfigError(
                f"ZeRO strategies support one LR scheduler, but `configure_optimizers` returned {len(schedulers)}. "
                "Combine them, e.g. with `torch.optim.lr_scheduler.SequentialLR`."
            )
        scheduler = schedulers[0] if schedulers else None
        return self._session.prepare_optimizer(optimizers[0], scheduler.scheduler if scheduler else None), scheduler

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # before Lightning's precision plugin casts the module: a float64 parameter is still float64 here
        check_parameters_for_zero(self._module())
        if self.zero_stage_3 and is_overridden("configure_model", self._module()):
            check_partitions_kept(self._module(), "`configure_model`", "in `__init__`")
        super().setup(trainer)

    @override
    def _setup_model_and_optimizer(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[deepspeed.DeepSpeedEngine, torch.optim.Optimizer]:
        engine, deepspeed_optimizer, _ = self._session.build_engine(model, optimizer, lr_scheduler)
        return engine, deepspeed_optimizer

    @override
    def _set_deepspeed_activation_checkpointing(self) -> None:
        # Lightning's passes 4 of the section's 6 keys to deepspeed.checkpointing.configure, which resets the others
        configure_deepspeed_checkpointing(self.config)

    @override
    def init_deepspeed(self) -> None:
        trainer = self._module().trainer
        self.__dict__.pop("_configured", None)  # left by a set-up that failed before Lightning took it
        if trainer.training and not self.several_models and "optimizer" not in self.config:
            configured = self._configured_optimizers()
            if len(configured[0]) > 1:  # a GAN under a plain name: one engine per model, if they can be inferred
                self._infer_models(configured[0])
                self._build_model_engines(training=True, configured=configured)
                keep_generation_in_step(self._module())
                return
            self.__dict__["_configured"] = configured  # for Lightning's _init_optimizers, called next
        if self.several_models:
            self._build_model_engines(training=trainer.training)
            keep_generation_in_step(self._module())
            return
        reusable = self._train_engine is not None and self._train_engine.module is self.lightning_module
        if not trainer.training and reusable:
            # validate/test/predict after fit: the training engine already holds the (sharded) weights
            stage = trainer.state.fn.value if trainer.state.fn is not None else "evaluation"
            check_same_parameters(self._trained_parameters, self._module(), stage)
            self.model = self._train_engine
            return
        if trainer.training and self._train_engine is not None:  # fit again: the last fit's engine is done
            release_engine(self._train_engine)
            self._train_engine = None
        super().init_deepspeed()
        if trainer.training:
            self._train_engine = self.model
            self._trained_parameters = parameter_ids(self._module())

    @override
    def _initialize_deepspeed_inference(self, model: torch.nn.Module) -> None:
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        remove_module_hooks(model)
        config = self._session.inference_config()
        self.model, _, _ = self._session.build_engine(model, None, None, config=config, training=False)

    @override
    def _engines_in_window(self) -> list[Any]:
        return list(self.trained_models.values()) if self.several_models else [self.model]

    @override
    def _engine_stepping(self, optimizer: Any) -> Any:
        return self._engine_for_optimizer(optimizer) if self.several_models else self.model
