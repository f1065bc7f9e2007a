"""Fabric's ZeRO strategy with several models, one engine each (see :mod:`lightspeed.core.zero.several_models`),
mirroring :mod:`lightspeed.strategies.several_models`.

In a Fabric loop every ``fabric.setup`` call already builds one engine (``fabric.backward(loss, model=...)`` picks
it). This mixin adds what several engines need beyond that:

* a model's own stage and offload targets: ``fabric.setup(lightspeed.fabric.model_options(teacher, stage=3))``;
* each optimizer's step counted on its own model's engine;
* ``fabric.save`` / ``fabric.load`` of a state holding several models: each trained model's engine in its own folder
  of one committed checkpoint (the layout the Trainer writes, which ``lightspeed export`` writes per model); models
  without an optimizer are frozen and not written.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies.deepspeed import _validate_state_keys
from lightning.fabric.utilities.load import _move_state_into
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero import load_policy
from lightspeed.core.zero.config.model_recipe import ModelOptions
from lightspeed.core.zero.several_models import (
    check_model_options,
    mark_model_options,
    model_options_of,
)
from lightspeed.fabric.mixin_bases import DeepSpeedStrategyBase

if TYPE_CHECKING:
    from lightspeed.core.zero.session import ZeroSession


__all__ = ["SeveralModelsMixin", "model_options"]


def model_options(
    module: Module,
    *,
    stage: int | None = None,
    offload_optimizer: str | bool | None = None,
    offload_parameters: str | bool | None = None,
) -> Module:
    """``module`` with its own ZeRO stage and offload targets for its engine (left out: the strategy's), e.g.
    ``fabric.setup(lightspeed.fabric.model_options(teacher, stage=3, offload_parameters="cpu"))`` beside a student
    under the strategy's ZeRO-2. Returns ``module``.

    Args:
        module: the model to set up with ``fabric.setup`` (marked in place).
        stage: its ZeRO stage 0-3; ``None``: the strategy's.
        offload_optimizer: ``"none"``, ``"cpu"`` or ``"nvme"`` for its optimizer states; ``None``: the strategy's.
        offload_parameters: ``"none"``, ``"cpu"`` or ``"nvme"`` for its parameters (stage 3); ``None``: the strategy's.
    """
    return mark_model_options(module, check_model_options(stage, offload_optimizer, offload_parameters))


class SeveralModelsMixin(DeepSpeedStrategyBase):
    """One engine per ``fabric.setup`` call, each with its model's own options; several-model checkpoints."""

    config: dict[str, Any]
    _recipe: dict[str, Any]
    _session: ZeroSession

    def _init_several_models(self, recipe_for: Callable[[ModelOptions], dict[str, Any]] | None) -> None:
        """``recipe_for``: the strategy's recipe with one model's options (None: the strategy gives none)."""
        self._recipe_for = recipe_for
        self.model_configs: dict[int, dict[str, Any]] = {}  # id(engine) -> its resolved config
        self._engine_of_optimizer: dict[int, Any] = {}  # id(optimizer fabric.setup returned) -> engine
        self._set_up_modules: set[int] = set()

    @contextmanager
    def _engine_config(self, module: Module) -> Generator[None, None, None]:
        """While ``module``'s engine is built: refuse a model set up twice, and resolve its own options' recipe."""
        if id(module) in self._set_up_modules:
            raise DeepSpeedConfigError(
                f"{type(module).__name__} was already set up by `fabric.setup`: a model given to two engines. Set up "
                "each model once, with its one optimizer."
            )
        options = model_options_of(module)
        if options is None:
            yield
            return
        if self._recipe_for is None:
            raise DeepSpeedConfigError(
                f"`lightspeed.fabric.model_options(...)` gave {type(module).__name__} its own stage, but "
                f"{type(self).__name__} chooses one configuration for every model. Use ZeroFabricStrategy(...)."
            )
        strategy_recipe, strategy_config = self._recipe, self.config
        self._recipe = self._recipe_for(options)  # resolved with the model by the set-up
        try:
            yield
        finally:
            self._recipe, self.config = strategy_recipe, strategy_config

    def _record_engine(self, module: Module, engine: Any, optimizer: Any | None) -> None:
        self._set_up_modules.add(id(module))
        self.model_configs[id(engine)] = self.config
        if optimizer is not None:
            self._engine_of_optimizer[id(optimizer)] = engine

    def _named_engines(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The engines in a ``fabric.save`` / ``fabric.load`` state, by their keys."""
        from deepspeed import DeepSpeedEngine

        return {key: value for key, value in state.items() if isinstance(value, DeepSpeedEngine)}

    def _several_models_target(self, path: Any) -> str:
        self._refuse_node_local_storage()
        return str(self.broadcast(str(path)))

    def _refuse_node_local_storage(self) -> None:
        if self._session.node_local_storage:
            raise DeepSpeedConfigError(
                "Checkpoints of several models do not support node_local_storage=True yet: save to a shared "
                "filesystem, or each model to its own path."
            )

    def _trains(self, engine: Any) -> bool:
        """Whether ``engine`` was set up with an optimizer (a frozen model's ZeRO-3 engine has DeepSpeed's parameter
        offloader as its ``optimizer``)."""
        return any(engine is trained for trained in self._engine_of_optimizer.values())

    def _engine_stepping(self, optimizer: Any) -> Any:
        """The engine of the model ``optimizer`` trains (the last one used otherwise)."""
        return self._engine_of_optimizer.get(id(optimizer), self._deepspeed_engine)

    # ------------------------------------------------------------------ checkpoints of several models
    def _save_models(self, engines: Mapping[str, Any], path: Any, state: Mapping[str, Any]) -> None:
        self._refuse_node_local_storage()
        trained = {key: engine for key, engine in engines.items() if self._trains(engine)}
        if not trained:
            raise ValueError("`fabric.save` got several models but none has an optimizer: nothing is trained.")
        excluded = [obj for engine in engines.values() for obj in (engine, engine.optimizer) if obj is not None]
        client_state = {k: v for k, v in state.items() if not any(v is obj for obj in excluded)}
        _validate_state_keys(client_state)  # the keys DeepSpeed keeps for itself, as for one model
        client_state = self._convert_stateful_objects_in_state(client_state, filter={})
        self._session.save_models(
            trained,
            {key: self.model_configs.get(id(engine), self.config) for key, engine in trained.items()},
            str(path),
            client_state,
            process=self,
            frozen=[key for key in engines if key not in trained],
            progress={"global_step": {key: int(engine.global_steps) for key, engine in trained.items()}},
        )

    def _load_models(
        self, engines: Mapping[str, Any], target: str, state: dict[str, Any], strict: bool
    ) -> dict[str, Any]:
        wants_optimizer = any(isinstance(value, Optimizer) or hasattr(value, "loss_scale") for value in state.values())
        client_state = load_policy.load_models(
            target,
            {key: engine.module for key, engine in engines.items()},
            dict(engines),
            trained=[key for key, engine in engines.items() if self._trains(engine)],
            world_size=self.world_size,
            strict=strict,
            rank=self.global_rank,
            warn=rank_zero_warn,
            load_optimizer_states=wants_optimizer,
        )
        # DeepSpeed adds its own 'optimizer' and 'lr_scheduler' keys (already restored); the rest goes back into
        # the user's state as Lightning's single-engine load does
        keys = set(client_state) & set(state) - set(engines) - {"optimizer", "lr_scheduler"}
        _move_state_into(source=client_state, destination=state, keys=keys)
        return client_state
