"""The Trainer's ZeRO strategy with several models in one LightningModule, each with its own DeepSpeed engine
(``ZeroStrategy(models={"generator": {}, "discriminator": {}})``; see :mod:`lightspeed.core.zero.several_models`).

A mixin placed before Lightning's ``DeepSpeedStrategy``. With ``models=`` the LightningModule itself is not wrapped
in an engine: each named attribute gets one, built with its own stage and offload targets and the optimizer of
``configure_optimizers`` that trains it (a model no optimizer trains is frozen; under ZeRO-3 it is partitioned by an
inference engine). Calling the attribute runs its engine; ``manual_backward`` / the automatic backward go to the
engine whose model the loss reaches, each optimizer's ``step()`` to its model's engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config import find_hidden_size, resolve_config
from lightspeed.core.zero.config.model_recipe import ModelOptions, ModelRecipe, model_recipes
from lightspeed.core.zero.engine import initialize_engine, one_optimizer_error, prepare_optimizer
from lightspeed.core.zero.release import release_engine
from lightspeed.core.zero.session import ZeroSession
from lightspeed.core.zero.several_models import (
    assign_optimizers,
    engine_for_backward,
    infer_models,
    model_dtype_for,
    parse_model_options,
    refuse_with_several_models,
    route_forward,
    without_training_sections,
)
from lightspeed.strategies._training_facts import collect_training_facts
from lightspeed.strategies.mixin_bases import DeepSpeedStrategyBase

__all__ = ["SEVERAL_MODELS_HINT", "SeveralModelsMixin"]

#: how this front end trains several models, each with its own optimizer (for the one-optimizer error)
SEVERAL_MODELS_HINT = (
    "give each its own engine: `ZeroStrategy(models=['generator', 'discriminator'])` with the attributes that hold them"
)


class SeveralModelsMixin(DeepSpeedStrategyBase):
    """One DeepSpeed engine per model named in ``models=`` (empty: Lightning's one engine for the whole module)."""

    _model_options: dict[str, ModelOptions]
    _model_recipes: dict[str, dict[str, Any]]
    _session: ZeroSession

    def _init_several_models(
        self, options: dict[str, ModelOptions], recipe: ModelRecipe | None, refused: Mapping[str, Any]
    ) -> None:
        """``options``: the models of ``models=`` (empty: one engine for the module); ``recipe``: the strategy's,
        which each model's config starts from (None: no models can be given or inferred); ``refused``: the strategy's
        arguments that one engine per model does not support, by name."""
        self._strategy_recipe = recipe
        self._not_with_several_models = dict(refused)
        self._use_models(options, "ZeroStrategy(models=...)")
        self.model_configs: dict[str, dict[str, Any]] = {}  # resolved, per model
        self.model_engines: dict[str, Any] = {}  # name -> engine (None: a frozen model without one)
        self._engine_of_optimizer: dict[int, Any] = {}
        self._route_undos: list[Callable[[], None]] = []

    def _use_models(self, options: dict[str, ModelOptions], argument: str) -> None:
        """Train the models ``options`` names with one engine each (``argument``: how they were given, for
        messages)."""
        self._model_options = options
        self._model_recipes = {}
        if options:
            assert self._strategy_recipe is not None
            refuse_with_several_models(options, argument, **self._not_with_several_models)
            self._model_recipes = model_recipes(options, self._strategy_recipe, argument)

    def _infer_models(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """``configure_optimizers`` returned several optimizers without ``models=``: one engine per model when each
        optimizer trains exactly one attribute's parameters (logged in one line); otherwise an error that says why
        and names ``models=``."""
        module = self.lightning_module
        assert module is not None
        several = f"{len(optimizers)} optimizers"
        if self._strategy_recipe is None:
            raise one_optimizer_error(several, "`configure_optimizers` returned", SEVERAL_MODELS_HINT)
        try:
            names = infer_models(module, optimizers, "`configure_optimizers`")
        except DeepSpeedConfigError as err:
            raise DeepSpeedConfigError(
                f"{one_optimizer_error(several, '`configure_optimizers` returned', SEVERAL_MODELS_HINT)} ({err}.)"
            ) from None
        argument = "the models inferred from `configure_optimizers`"
        self._use_models(parse_model_options(names, argument), argument)
        rank_zero_info(
            f"lightspeed: `configure_optimizers` returned {several}, each training one attribute's parameters: one "
            f"engine per model, as with ZeroStrategy(models={names!r})."
        )

    @property
    def several_models(self) -> bool:
        """Whether this strategy trains the models named in ``models=`` with one engine each."""
        return bool(self.__dict__.get("_model_options"))

    @property
    def trained_models(self) -> dict[str, Any]:
        """Name -> engine of every model an optimizer trains, in ``models=`` order (a frozen model's ZeRO-3 engine
        has DeepSpeed's parameter offloader as its ``optimizer``, so the engines built with an optimizer are kept)."""
        trained = set(map(id, self._engine_of_optimizer.values()))
        return {n: e for n, e in self.model_engines.items() if id(e) in trained}

    @property
    def frozen_models(self) -> list[str]:
        """The models no optimizer trains (not written to checkpoints or exports)."""
        return [n for n in self.model_engines if n not in self.trained_models]

    def _named_models(self) -> dict[str, nn.Module]:
        module = self.lightning_module
        assert module is not None
        models = {}
        for name in self._model_options:
            model = getattr(module, name, None)
            if not isinstance(model, nn.Module):
                raise DeepSpeedConfigError(
                    f"`models=` names {name!r}, but {type(module).__name__}.{name} is "
                    f"{'missing' if model is None else type(model).__name__}: name the attributes that hold the "
                    "models (nn.Module), e.g. models={'generator': {}, 'discriminator': {}}."
                )
            models[name] = model
        return models

    def _build_model_engines(
        self, training: bool, configured: tuple[list[torch.optim.Optimizer], list[Any]] | None = None
    ) -> None:
        """One engine per named model (training: with its optimizer from ``configure_optimizers``, or of
        ``configured``, its optimizers and scheduler configs if it ran already; frozen models and evaluation: an
        inference engine under ZeRO-3, none otherwise); calls of each model run its engine."""
        if self.model_engines:
            if not training or self.trained_models:
                return  # evaluation after fit: the training engines hold the weights
            self._drop_model_engines()  # fit after an evaluation: engines with optimizers this time
        self._session.release_other_runs()
        module = self.lightning_module
        assert module is not None
        models = self._named_models()
        optimizers: list[torch.optim.Optimizer] = []
        schedulers: list[Any] = []
        if training:
            optimizers, schedulers = configured or _init_optimizers_and_lr_schedulers(module)
        assigned = assign_optimizers(models, optimizers, "`configure_optimizers`")
        facts = collect_training_facts(module, self.world_size, self.precision_plugin.precision, {})
        converted: dict[int, Any] = {}  # optimizer index -> what Lightning steps (see _ModelOptimizer)
        for name, model in models.items():
            config = resolve_config(
                self._model_recipes[name], dataclasses.replace(facts, hidden_size=find_hidden_size(model))
            )
            self.model_configs[name] = config
            index = assigned[name]
            if index is None:
                self.model_engines[name] = self._frozen_engine(name, model, config, training)
                continue
            optimizer = optimizers[index]
            scheduler = next((s for s in schedulers if s.scheduler.optimizer is optimizer), None)
            optimizer, message = prepare_optimizer(optimizer, scheduler.scheduler if scheduler else None, config)
            if message is not None:
                rank_zero_info(f"lightspeed: {name}: {message}")
            engine, deepspeed_optimizer, _ = initialize_engine(
                config,
                model,
                optimizer,
                None,
                self.root_device.index,
                self.local_rank,
                self._session.leaf_modules,
                unused_parameters=self._session.unused_parameters,
            )
            self.model_engines[name] = engine
            self._session.own(engine)
            seen = _ModelOptimizer(deepspeed_optimizer, model.parameters())
            self._engine_of_optimizer[id(seen)] = engine
            converted[index] = seen
        for name, engine in self.model_engines.items():
            if engine is not None:
                self._route_undos.append(route_forward(models[name], engine))
        self.optimizers = [converted[i] for i in range(len(optimizers))]
        self.lr_scheduler_configs = schedulers
        self.model = module
        stages = ", ".join(
            f"{n}: ZeRO-{self.model_configs[n]['zero_optimization']['stage']}"
            + ("" if n in self.trained_models else " (frozen)")
            for n in models
        )
        rank_zero_info(f"lightspeed: one engine per model: {stages}")

    def _frozen_engine(self, name: str, model: nn.Module, config: dict[str, Any], training: bool) -> Any:
        """A model no optimizer trains (every model outside ``fit``): partitioned by an inference engine under
        ZeRO-3, otherwise kept whole on the device in the weights' dtype; frozen when training."""
        if training and any(p.requires_grad for p in model.parameters()):
            model.requires_grad_(False)
            rank_zero_info(f"lightspeed: {name!r} has no optimizer: its parameters are frozen (requires_grad=False).")
        if int(config["zero_optimization"].get("stage", 0)) == 3:
            engine, _, _ = initialize_engine(
                without_training_sections(config),
                model,
                None,
                None,
                self.root_device.index,
                self.local_rank,
                self._session.leaf_modules,
            )
            self._session.own(engine)
            return engine
        model.to(device=self.root_device, dtype=model_dtype_for(config))
        return None

    def _drop_model_engines(self) -> None:
        """Forget and release the models' engines (a failed run's, or an evaluation's before ``fit``): calls of the
        models run them no more, and the next set-up builds new ones."""
        undos, self._route_undos = self._route_undos, []
        for undo in undos:
            undo()
        for engine in self.model_engines.values():
            if engine is not None:
                release_engine(engine)
        self.model_engines.clear()
        self._engine_of_optimizer.clear()

    def _engine_for_optimizer(self, optimizer: Any) -> Any:
        engine = self._engine_of_optimizer.get(id(optimizer))
        if engine is None:
            raise DeepSpeedConfigError(
                f"{type(optimizer).__name__} is not the optimizer of any model's engine; step the optimizers "
                "`self.optimizers()` returns."
            )
        return engine

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if not self.several_models:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        assert module is not None
        if optimizer is not None:
            engine = self._engine_for_optimizer(optimizer)
        else:  # manual_backward(loss): the engine of the model the loss reaches
            trained = {n: (e, list(e.module.parameters())) for n, e in self.trained_models.items()}
            engine = engine_for_backward(closure_loss, trained)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        engine.backward(closure_loss, *args, **kwargs)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if not self.several_models:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        module = model if model is not None else self.lightning_module
        assert module is not None
        closure_result = closure()
        self.precision_plugin._after_closure(module, optimizer)
        if module.automatic_optimization and closure_result is None:
            raise MisconfigurationException(
                "Skipping backward by returning `None` from your `training_step` is not supported by ZeRO strategies."
            )
        return self._engine_for_optimizer(optimizer).step(**kwargs)


class _ModelOptimizer:
    """What Lightning sees as one model's optimizer: DeepSpeed's (every call goes to it), except that
    ``param_groups`` list the model's own parameters instead of ZeRO's flat partitions, so that
    ``LightningModule.toggle_optimizer(opt)`` freezes the other models while one model's loss is computed."""

    def __init__(self, optimizer: Any, parameters: Any) -> None:
        self._deepspeed_optimizer = optimizer
        self._model_parameters = list(parameters)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        groups = self._deepspeed_optimizer.param_groups
        return [{**group, "params": self._model_parameters if i == 0 else []} for i, group in enumerate(groups)]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_deepspeed_optimizer"):  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self._deepspeed_optimizer, name)
