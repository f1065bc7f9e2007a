"""``zero_auto``: a ZeRO strategy that measures the model and the machine at setup and configures itself as the
fastest ZeRO option that fits (see :mod:`lightspeed.core.zero.planner`), logging the table and the choice.

The choice is made when the DeepSpeed config is first needed: in ``configure_model`` (Lightning's
``model_sharded_context``) when the model already has its parameters, else in ``setup`` after ``configure_model``
built them in full (then ZeRO-3 partitions them at ``deepspeed.initialize``). Every rank measures its own devices
and host memory; the smallest budgets across ranks decide, so all ranks make the same choice.

``tune=True`` measures instead of assuming (:mod:`lightspeed.core.zero.tuner`): before ``fit`` trains, a few real
steps of every option that fits, on copies of the model and its optimizer and the run's first batches; the fastest
wins and is remembered in a JSON cache. With ``tune_micro_batches`` the candidates also differ in micro-batch size,
each with the accumulation that keeps the samples per optimizer step; a chosen size re-batches the training
DataLoader (``process_dataloader``) and sets the Trainer's ``accumulate_grad_batches``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.data import (
    _get_dataloader_init_args_and_kwargs,
    _reinstantiate_wrapped_cls,
    _replace_value_in_saved_args,
)
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader
from typing_extensions import Unpack, override

from lightspeed.core.zero.config import resolve_config_with_notes
from lightspeed.core.zero.planner import Plan, ZeroOption
from lightspeed.core.zero.tuner import TrialParts, first_batches, zero_auto_arguments
from lightspeed.strategies._training_facts import collect_training_facts
from lightspeed.strategies._tuning import copy_lightning_module, training_loss
from lightspeed.strategies.zero import ZeroStrategy
from lightspeed.strategies.zero_keywords import TRAINER_DEFAULTS, TrainerZeroAutoKeywords

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ZeroAutoStrategy"]


class ZeroAutoStrategy(ZeroStrategy):
    """ZeRO with the stage and offload chosen from the model size and the memory of this machine.

    Args:
        **arguments: :class:`~lightspeed.strategies.zero_keywords.TrainerZeroAutoKeywords`, each with its default
            when left out: the memory plan's and the tuner's (``safety_margin``, ``device_memory``, ``host_memory``,
            ``nvme_path``, ``optimizer_state_bytes``, ``config``, ``tune``, ``tune_steps``, ``tune_options``,
            ``tune_buckets``, ``tune_micro_batches``, ``tune_cache``, ``retune``) and the other :class:`ZeroStrategy`
            arguments, as there (bucket sizes, applied to whichever stage is chosen where that stage has them;
            activation checkpointing; low-memory states, counted by the plan; ``leaf_modules``, marked when ZeRO-3
            is chosen; ``sequence_parallel_size``, not with ``tune=True``; ...). ``stage``, ``offload_optimizer``
            and ``offload_parameters`` are chosen here: passing one is an error.
    """

    strategy_name = "zero_auto"

    def __init__(self, **arguments: Unpack[TrainerZeroAutoKeywords]) -> None:
        owner = type(self).__name__
        self.request, self.tune_request, given = zero_auto_arguments(
            arguments, ZeroAutoStrategy, owner, "Trainer", TRAINER_DEFAULTS
        )
        self._init_lightning(self.request.user_config, given)
        self.memory_plan: Plan | None = None
        self.chosen_option: ZeroOption | None = None
        #: the micro-batch size the tuner chose when it differs from the DataLoader's (``tune_micro_batches``)
        self.tuned_micro_batch: int | None = None

    # ------------------------------------------------------------------ measuring and choosing
    def _accumulation(self) -> int | None:
        """The Trainer's ``accumulate_grad_batches`` (None without a Trainer attached)."""
        try:
            return int(self.lightning_module.trainer.accumulate_grad_batches)  # type: ignore[union-attr]
        except (AttributeError, RuntimeError):
            return None

    def _model_has_parameters(self) -> bool:
        module = self.lightning_module
        return module is not None and any(True for _ in module.parameters())

    def choose(self) -> ZeroOption:
        """Measure, plan, log the table and configure this strategy as the chosen option."""
        devices = len(self.parallel_devices or ())
        precision = self.precision_plugin.precision
        decision = self.request.decide(
            self._module(), devices, self.num_nodes, precision, self.root_device, rank_zero_info, self._accumulation()
        )
        self.memory_plan = decision.plan
        self.config = decision.config
        self.chosen_option = decision.option
        if self.tune_request.tune:
            self._tune(decision.plan)
        return self.chosen_option

    def _tune(self, plan: Plan) -> None:
        """Measure the candidates that fit and configure this strategy as the fastest (``fit`` only)."""
        module = self._module()
        trainer = module.trainer
        if trainer.state.fn != TrainerFn.FITTING or not module.automatic_optimization:
            rank_zero_info(
                "lightspeed zero_auto: tune=True measures training steps, so it runs in `fit` with automatic "
                "optimization only; using the planner's choice."
            )
            return
        if self.tune_request.micro_batches is not None and any(
            isinstance(callback, GradientAccumulationScheduler) for callback in getattr(trainer, "callbacks", [])
        ):
            raise ValueError(
                "tune_micro_batches sets accumulate_grad_batches to keep the samples per optimizer step, but a "
                "GradientAccumulationScheduler changes it every epoch; remove one of the two."
            )
        loader = trainer.fit_loop._data_source.dataloader()  # the user's loader, as Lightning will set it up
        trial = TrialParts(
            copy_model=lambda: copy_lightning_module(module),
            resolve=lambda config: self._resolved(config, module),
            loss=lambda model, batch, index: training_loss(
                model, self.precision_plugin.convert_input(move_data_to_device(batch, self.root_device)), index
            ),
            take_batches=lambda n, size: first_batches(loader, n, size),
            micro_batch=getattr(loader, "batch_size", None),
            process=self,
            precision=str(self.precision_plugin.precision),
            accumulation=trainer.accumulate_grad_batches,
        )
        chosen = self.tune_request.choose(plan, self.request, module, trial, info=rank_zero_info)
        self.chosen_option = chosen.option
        self.config = chosen.config(self.request)
        if chosen.micro_batch is not None and chosen.accumulation is not None:
            self.tuned_micro_batch = chosen.micro_batch
            trainer.accumulate_grad_batches = chosen.accumulation
            rank_zero_info(
                f"lightspeed zero_auto: training with micro-batches of {chosen.micro_batch} and "
                f"accumulate_grad_batches={chosen.accumulation} (the same samples per optimizer step as the "
                f"DataLoader's batch_size={trial.micro_batch} x accumulate_grad_batches={trial.accumulation})."
            )

    def _resolved(self, config: dict[str, Any], module: pl.LightningModule) -> dict[str, Any]:
        facts = collect_training_facts(module, self.world_size, self.precision_plugin.precision, config)
        return resolve_config_with_notes(config, facts)[0]

    # ------------------------------------------------------------------ hooks
    @override
    def _trained_micro_batch(self) -> int | None:
        return self.tuned_micro_batch

    @override
    def process_dataloader(self, dataloader: object) -> object:
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        if (
            self.tuned_micro_batch is not None
            and trainer is not None
            and trainer.state.stage == RunningStage.TRAINING
            and isinstance(dataloader, DataLoader)
            and dataloader.batch_size != self.tuned_micro_batch
        ):
            dataloader = with_batch_size(dataloader, self.tuned_micro_batch)
        return super().process_dataloader(dataloader)

    @override
    def _format_config(self) -> None:
        if self.chosen_option is None:
            self.choose()
        super()._format_config()

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        if self.chosen_option is None and not self._model_has_parameters():
            # the layers are created in configure_model: build them in full, measure and choose afterwards
            yield
            return
        with super().model_sharded_context():
            yield


def with_batch_size(loader: DataLoader, batch_size: int) -> DataLoader:
    """``loader`` built again (its class, arguments and sampler) with ``batch_size``, through Lightning's
    re-instantiation of DataLoaders (the one that injects the distributed sampler)."""
    args, kwargs = _get_dataloader_init_args_and_kwargs(loader, loader.sampler)
    saved_names: tuple[str, ...] = getattr(loader, "__pl_saved_arg_names", ())
    defaults: dict[str, Any] = getattr(loader, "__pl_saved_default_kwargs", {})
    replaced, args, kwargs = _replace_value_in_saved_args("batch_size", batch_size, args, kwargs, defaults, saved_names)
    if not replaced:
        kwargs["batch_size"] = batch_size
    return _reinstantiate_wrapped_cls(loader, *args, **kwargs)
