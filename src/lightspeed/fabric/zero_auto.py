"""``zero_auto`` for Lightning Fabric: the ZeRO stage and offload chosen at ``fabric.setup`` from the model's size and
this machine's memory (the Trainer's is :mod:`lightspeed.strategies.zero_auto`; both call
:class:`~lightspeed.core.zero.auto_choice.ZeroAutoRequest`)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightspeed.core.zero.config import resolve_config_with_notes
from lightspeed.core.zero.engine import one_optimizer_error
from lightspeed.core.zero.planner import Plan, ZeroOption
from lightspeed.core.zero.tuner import TrialParts, copy_module_and_optimizer, first_batches, zero_auto_arguments
from lightspeed.fabric.config_optimizer import ConfigOptimizer
from lightspeed.fabric.keywords import SEVERAL_MODELS
from lightspeed.fabric.zero import ZeroFabricStrategy
from lightspeed.fabric.zero_keywords import FABRIC_DEFAULTS, FabricZeroAutoKeywords

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

__all__ = ["ZeroAutoFabricStrategy"]


class ZeroAutoFabricStrategy(ZeroFabricStrategy):
    """``zero_auto`` for Fabric: the ZeRO stage and offload are chosen at ``fabric.setup`` from the model's size and
    this machine's memory (the smallest budgets over all ranks), logged as a table.

    Under ``fabric.init_module()`` the model is built in full (the choice needs it); ``deepspeed.initialize`` then
    partitions it if ZeRO-3 is chosen. Arguments as the Trainer's :class:`~lightspeed.strategies.ZeroAutoStrategy`;
    ``tune=True`` (measure the options that fit at ``fabric.setup``) also needs what the Trainer knows from its loop:

    Args:
        **arguments: :class:`~lightspeed.fabric.zero_keywords.FabricZeroAutoKeywords`, each with its default when
            left out: as for the Trainer's :class:`~lightspeed.strategies.ZeroAutoStrategy` (the memory plan's and
            the tuner's, and the other :class:`ZeroFabricStrategy` arguments; ``tune=True`` measures at
            ``fabric.setup``), and what tuning needs from the loop: ``tune_batches`` and ``tune_loss``. ``stage``,
            ``offload_optimizer`` and ``offload_parameters`` are chosen here: passing one is an error.
    """

    def __init__(self, **arguments: Unpack[FabricZeroAutoKeywords]) -> None:
        self._tune_batches, self._tune_loss = arguments.pop("tune_batches", None), arguments.pop("tune_loss", None)
        owner = type(self).__name__
        self.request, self.tune_request, given = zero_auto_arguments(
            arguments, ZeroAutoFabricStrategy, owner, "Fabric", FABRIC_DEFAULTS
        )
        if self.tune_request.tune and (self._tune_batches is None or self._tune_loss is None):
            raise TypeError(
                "ZeroAutoFabricStrategy(tune=True) measures training steps, but Fabric's strategy does not see the "
                "loop: pass tune_batches= (this rank's training DataLoader) and tune_loss= (a function (model, batch) "
                "-> loss, as the loop computes it)."
            )
        self._init_lightning(self.request.user_config, given)
        self.memory_plan: Plan | None = None
        self.chosen_option: ZeroOption | None = None
        #: the fastest micro-batch size and its accumulation, when ``tune_micro_batches`` found one faster than the
        #: loop's (reported only: the loop owns its DataLoader and accumulation)
        self.tuned_micro_batch: int | None = None
        self.tuned_accumulation: int | None = None

    def choose(self, module: Module) -> ZeroOption:
        """Measure, plan, log the table and configure this strategy as the chosen option."""
        devices = len(self.parallel_devices or ())
        decision = self.request.decide(
            module, devices, self.num_nodes, self.precision.precision, self.root_device, rank_zero_info
        )
        self.memory_plan = decision.plan
        self._recipe = decision.config
        self.config = self._recipe
        self.chosen_option = decision.option
        return decision.option

    def _tune(self, module: Module, optimizer: Any) -> None:
        """Measure the candidates that fit (copies of ``module`` and ``optimizer``) and configure this strategy as
        the fastest."""
        assert self.memory_plan is not None and self._tune_batches is not None and self._tune_loss is not None
        batches, loss = self._tune_batches, self._tune_loss
        trial = TrialParts(
            copy_model=lambda: copy_module_and_optimizer(module, optimizer),
            resolve=lambda config: resolve_config_with_notes(config, self._facts(module))[0],
            loss=lambda model, batch, index: loss(model, move_data_to_device(batch, self.root_device)),
            take_batches=lambda n, size: first_batches(batches, n, size),
            micro_batch=getattr(batches, "batch_size", None),
            process=self,
            precision=str(self.precision.precision),
            accumulation=self.accumulation_steps_in_config or 1,
        )
        chosen = self.tune_request.choose(self.memory_plan, self.request, module, trial, info=rank_zero_info)
        if chosen.micro_batch is not None and chosen.accumulation is not None:
            self.tuned_micro_batch, self.tuned_accumulation = chosen.micro_batch, chosen.accumulation
            rank_zero_info(
                f"lightspeed zero_auto: micro-batches of {chosen.micro_batch} with {chosen.accumulation} per optimizer "
                f"step trained fastest (the same samples per step as {trial.micro_batch} x {trial.accumulation}). "
                "Fabric's loop owns its DataLoader: build it with batch_size="
                f"{chosen.micro_batch} and accumulate {chosen.accumulation} micro-batches per step to use it "
                "(strategy.tuned_micro_batch, strategy.tuned_accumulation); this run keeps its own batches."
            )
        self.chosen_option = chosen.option
        self._recipe = chosen.config(self.request)
        self.config = self._recipe

    @override
    def _format_config(self) -> None:
        if self.chosen_option is not None:
            super()._format_config()
        # else: nothing to resolve until the model is known (fabric.setup chooses)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        if self.chosen_option is None:
            # the choice needs the model: build it in full; deepspeed.initialize partitions it under ZeRO-3
            return DDPStrategy.module_init_context(self, empty_init=empty_init)
        return super().module_init_context(empty_init=empty_init)

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[DeepSpeedEngine, list[Optimizer], Any]:
        if len(optimizers) != 1:
            raise one_optimizer_error(f"{len(optimizers)} optimizers", "`fabric.setup` got", SEVERAL_MODELS)
        if self.chosen_option is None:
            self.choose(module)
            if self.tune_request.tune:
                optimizer = None if isinstance(optimizers[0], ConfigOptimizer) else optimizers[0]
                self._tune(module, optimizer)
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    @override
    def setup_module(self, module: Module) -> DeepSpeedEngine:
        if self.chosen_option is None:
            self.choose(module)
            if self.tune_request.tune:
                rank_zero_info(
                    "lightspeed zero_auto: tune=True measures training steps; `fabric.setup` without an optimizer "
                    "does not train, so the planner's choice is used."
                )
        return super().setup_module(module)
