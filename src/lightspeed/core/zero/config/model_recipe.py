"""What a ZeRO strategy builds its DeepSpeed configs from: :class:`ModelRecipe`, the strategy's checked arguments,
which every run uses for its one config (:meth:`ModelRecipe.config`) and a run of several models for each model's
own (:meth:`ModelRecipe.for_model` with that model's :class:`ModelOptions`, :func:`model_recipes`)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config.choices import check_zero_stage, offload_target
from lightspeed.core.zero.config.zero_recipe import ZeroTuning, build_zero_config

__all__ = ["ModelOptions", "ModelRecipe", "arguments_outside_recipe", "model_recipes"]

#: the constructor arguments a :class:`ModelRecipe` reads (:meth:`ModelRecipe.from_arguments`)
RECIPE_ARGUMENTS = frozenset(
    {"stage", "offload_optimizer", "offload_parameters", "nvme_path", "config"}
    | {field.name for field in dataclasses.fields(ZeroTuning)}
)


def arguments_outside_recipe(arguments: Mapping[str, Any], *functions: Callable[..., Any]) -> dict[str, Any]:
    """Those of a front end's constructor ``arguments`` (by name) that ``functions`` take and the recipe does not
    read: what a strategy hands to the framework's own constructor, which must not see the ZeRO arguments again (the
    config built from them is the one in force)."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    taken = {
        name
        for function in functions
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind in named and name != "self"
    }
    return {name: value for name, value in arguments.items() if name in taken - RECIPE_ARGUMENTS}


@dataclass(frozen=True)
class ModelOptions:
    """One model's own ZeRO stage and offload targets; ``None`` takes the strategy's."""

    stage: int | None = None
    offload_optimizer: str | None = None
    offload_parameters: str | None = None

    def over(self, stage: int, offload_optimizer: str, offload_parameters: str) -> ModelOptions:
        """These options with the strategy's filled in where left out."""
        return ModelOptions(
            stage if self.stage is None else self.stage,
            offload_optimizer if self.offload_optimizer is None else self.offload_optimizer,
            offload_parameters if self.offload_parameters is None else self.offload_parameters,
        )


@dataclass(frozen=True)
class ModelRecipe:
    """What a ZeRO strategy builds its DeepSpeed config from (:meth:`config`), kept so that each model can get its own
    (:meth:`for_model`): the strategy's stage and offload targets (checked), NVMe directory, user config, tuning and
    front end."""

    stage: int
    offload_optimizer: str
    offload_parameters: str
    nvme_path: Any
    user_config: Any
    tuning: ZeroTuning
    front_end: str

    def __post_init__(self) -> None:
        """Check the stage and normalise the offload targets (``True`` -> ``"cpu"``, ``None``/``False`` ->
        ``"none"``) whichever way the recipe is built."""
        object.__setattr__(self, "stage", check_zero_stage(self.stage))
        object.__setattr__(self, "offload_optimizer", offload_target(self.offload_optimizer, "offload_optimizer"))
        object.__setattr__(self, "offload_parameters", offload_target(self.offload_parameters, "offload_parameters"))

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any], front_end: str) -> ModelRecipe:
        """The recipe from a ZeRO front end's arguments by name, defaults filled in
        (:func:`~lightspeed.core.zero.config.arguments.zero_arguments`): ``stage``, the offload targets, ``nvme_path``,
        ``config`` and every :class:`~lightspeed.core.zero.config.zero_recipe.ZeroTuning` field."""
        tuning = ZeroTuning(**{field.name: arguments[field.name] for field in dataclasses.fields(ZeroTuning)})
        return cls(
            arguments["stage"],
            arguments["offload_optimizer"],
            arguments["offload_parameters"],
            nvme_path=arguments["nvme_path"],
            user_config=arguments["config"],
            tuning=tuning,
            front_end=front_end,
        )

    def config(self) -> dict[str, Any]:
        """The strategy's own config (with ``"auto"`` values), from its arguments as given."""
        return build_zero_config(
            self.stage,
            self.offload_optimizer,
            self.offload_parameters,
            nvme_path=self.nvme_path,
            user_config=self.user_config,
            tuning=self.tuning,
            front_end=self.front_end,
        )

    def for_model(self, options: ModelOptions) -> dict[str, Any]:
        """The config (with ``"auto"`` values) of a model with ``options``, the strategy's where left out."""
        own = options.over(self.stage, self.offload_optimizer, self.offload_parameters)
        stage = int(own.stage or 0)
        return build_zero_config(
            stage,
            own.offload_optimizer,
            own.offload_parameters,
            nvme_path=self.nvme_path,
            user_config=self.user_config,
            tuning=self.tuning.for_stage(stage),
            front_end=self.front_end,
        )


def model_recipes(options: Mapping[str, ModelOptions], recipe: ModelRecipe, argument: str) -> dict[str, dict[str, Any]]:
    """Each model's DeepSpeed config (still with ``"auto"`` values) from its options over the strategy's ``recipe``;
    a user config that sets another stage than a model asks for, or an optimizer section (which one model would it
    train?), is an error."""
    recipes: dict[str, dict[str, Any]] = {}
    for name, model_options in options.items():
        built = recipe.for_model(model_options)
        stage = int((built.get("zero_optimization") or {}).get("stage", 0))
        wanted = recipe.stage if model_options.stage is None else model_options.stage
        if stage != wanted:
            raise DeepSpeedConfigError(
                f"{argument}[{name!r}] asks for ZeRO stage {wanted}, but the DeepSpeed config sets "
                f'"zero_optimization": {{"stage": {stage}}}. Remove the stage from the config: with several models '
                "each model's stage comes from the strategy and its options."
            )
        if "optimizer" in built or "scheduler" in built:
            raise DeepSpeedConfigError(
                f"The DeepSpeed config has an optimizer or scheduler section, but {argument} trains several models, "
                "each with the optimizer `configure_optimizers` (or `fabric.setup`) gives it. Remove the section."
            )
        recipes[name] = built
    return recipes
