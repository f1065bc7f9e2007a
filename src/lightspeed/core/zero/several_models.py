"""Several models in one training module, each with its own DeepSpeed engine: a GAN's generator and discriminator
(two optimizers), a student beside a frozen teacher that only runs forward (partitioned under ZeRO-3, no optimizer).

One DeepSpeed engine trains one model with one optimizer, so a module holding several models gets one engine per
model. This module holds what both front ends share:

* :func:`parse_model_options` / :func:`mark_model_options`: a model's own stage and offload targets
  (:class:`~lightspeed.core.zero.config.model_recipe.ModelOptions`, the strategy's where left out), checked when given;
  :class:`~lightspeed.core.zero.config.model_recipe.ModelRecipe` builds each model's config;
* :func:`assign_optimizers`: which model each optimizer trains, refusing two optimizers for one model and one
  optimizer over two models;
* :func:`infer_models`: the models of a module given several optimizers and no ``models=`` (a GAN under a plain
  strategy name), when each optimizer trains exactly one attribute's parameters;
* :func:`route_forward`: calling the model itself (``self.generator(z)``) runs its engine's forward, which DeepSpeed
  needs to prepare the backward (its output hooks) and ZeRO-3 to fetch parameters;
* :func:`engine_for_backward`: the one trained engine a loss reaches, found by walking the autograd graph, so
  ``manual_backward(loss)`` / ``loss`` without a model argument goes to the right engine;
* the checkpoint layout (written by :func:`~lightspeed.core.zero.engine.save_models_checkpoint`, read by
  :func:`~lightspeed.core.zero.load_policy.models_in_checkpoint` and the exporter): one DeepSpeed save directory per
  trained model inside the committed checkpoint, the trained models listed in its completion marker
  (:data:`~lightspeed.core.reliability.staging.MODELS_MANIFEST_KEY`).

No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config.choices import check_zero_stage, offload_target
from lightspeed.core.zero.config.model_recipe import ModelOptions

__all__ = [
    "assign_optimizers",
    "check_model_options",
    "engine_for_backward",
    "infer_models",
    "mark_model_options",
    "model_dtype_for",
    "model_options_of",
    "parse_model_options",
    "refuse_with_several_models",
    "route_forward",
    "without_training_sections",
]

_OPTION_KEYS = ("stage", "offload_optimizer", "offload_parameters")


def parse_model_options(models: Mapping[str, Any] | Sequence[str] | None, argument: str) -> dict[str, ModelOptions]:
    """``models`` as given to a strategy (attribute name -> options dict, or a list of names that take the
    strategy's stage) checked into :class:`ModelOptions`; ``argument`` is how the user wrote it, for messages."""
    if models is None:
        return {}
    if isinstance(models, str) or not isinstance(models, (Mapping, list, tuple)):
        raise DeepSpeedConfigError(
            f"{argument} must map each model's attribute name to its options, e.g. "
            f'{{"generator": {{}}, "teacher": {{"stage": 3}}}}, got {models!r}.'
        )
    items = models.items() if isinstance(models, Mapping) else ((name, {}) for name in models)
    parsed: dict[str, ModelOptions] = {}
    for name, options in items:
        if not isinstance(name, str) or not name.isidentifier():
            raise DeepSpeedConfigError(f"{argument}: {name!r} is not an attribute name of the module.")
        if isinstance(options, ModelOptions):
            parsed[name] = options
            continue
        if not isinstance(options, Mapping):
            raise DeepSpeedConfigError(
                f"{argument}[{name!r}] must be a dict of options ({', '.join(_OPTION_KEYS)}), got {options!r}."
            )
        unknown = sorted(set(options) - set(_OPTION_KEYS))
        if unknown:
            raise DeepSpeedConfigError(
                f"{argument}[{name!r}] has unknown option(s) {', '.join(map(repr, unknown))}; a model takes "
                f"{', '.join(_OPTION_KEYS)}. Everything else is set on the strategy for all models."
            )
        parsed[name] = check_model_options(**options)
    if len(parsed) < 2:
        raise DeepSpeedConfigError(
            f"{argument} names {len(parsed)} model(s); it is for modules holding several models, each with its own "
            "engine. Leave it out to train the whole module with one engine."
        )
    return parsed


_OPTIONS_ATTRIBUTE = "_lightspeed_zero_options"


def refuse_with_several_models(options: Mapping[str, ModelOptions], argument: str, **given: Any) -> None:
    """Refuse the arguments in ``given`` that are set (truthy) when ``options`` names several models: one engine
    per model does not support them yet."""
    refused = [name for name, value in given.items() if value] if options else []
    if refused:
        raise DeepSpeedConfigError(
            f"{argument} cannot be combined with {', '.join(refused)} yet: train the models with one engine (leave "
            "out models=) or drop these arguments."
        )


def mark_model_options(module: nn.Module, options: ModelOptions) -> nn.Module:
    """Give ``module`` its own stage and offload targets, read when its engine is built (Fabric: ``fabric.setup``)."""
    setattr(module, _OPTIONS_ATTRIBUTE, options)
    return module


def model_options_of(module: nn.Module) -> ModelOptions | None:
    """The options :func:`mark_model_options` gave ``module``, None if it has none."""
    options = getattr(module, _OPTIONS_ATTRIBUTE, None)
    return options if isinstance(options, ModelOptions) else None


def check_model_options(
    stage: Any = None, offload_optimizer: str | bool | None = None, offload_parameters: str | bool | None = None
) -> ModelOptions:
    """One model's options, checked (``None``: the strategy's)."""
    return ModelOptions(
        None if stage is None else check_zero_stage(stage),
        None if offload_optimizer is None else offload_target(offload_optimizer, "offload_optimizer"),
        None if offload_parameters is None else offload_target(offload_parameters, "offload_parameters"),
    )


def assign_optimizers(
    models: Mapping[str, nn.Module], optimizers: Sequence[torch.optim.Optimizer], where: str
) -> dict[str, int | None]:
    """Which optimizer (by its index in ``optimizers``) trains each model; None for a model no optimizer trains.

    ``where`` says where the optimizers came from (``"`configure_optimizers`"``). Raises one
    :class:`DeepSpeedConfigError` when an optimizer trains parameters of several models or of none of them, or
    when two optimizers train one model: each engine owns exactly one model and at most one optimizer.
    """
    owner = {id(p): name for name, model in models.items() for p in model.parameters()}
    assigned: dict[str, int | None] = dict.fromkeys(models)
    for index, optimizer in enumerate(optimizers):
        owners = {owner.get(id(p)) for group in optimizer.param_groups for p in group["params"]}
        if None in owners:
            raise DeepSpeedConfigError(
                f"Optimizer {index} from {where} trains parameters outside the models named in `models=` "
                f"({', '.join(models)}). Give each model its own optimizer over its own parameters, or add the "
                "model those parameters belong to."
            )
        if len(owners) > 1:
            names = sorted(n for n in owners if n is not None)
            raise DeepSpeedConfigError(
                f"Optimizer {index} from {where} trains parameters of {' and '.join(map(repr, names))}: a model "
                "given to two engines. Each model has its own engine and optimizer; split the optimizer per model."
            )
        (name,) = owners
        assert name is not None
        previous = assigned[name]
        if previous is not None:
            raise DeepSpeedConfigError(
                f"Optimizers {previous} and {index} from {where} both train {name!r}: two optimizers for one model. "
                "A ZeRO engine steps one optimizer; use one optimizer with several param groups."
            )
        assigned[name] = index
    return assigned


def infer_models(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], where: str) -> list[str]:
    """The attributes of ``module`` to give one engine each when ``optimizers`` (from ``where``) are several and no
    ``models=`` was given: each optimizer must train exactly the parameters of one child module (``self.generator``),
    a different one each; children no optimizer trains are added as frozen models. Raises a
    :class:`DeepSpeedConfigError` saying why otherwise (the caller adds how to name the models)."""
    owned = {name: {id(p) for p in child.parameters()} for name, child in module.named_children()}
    owned = {name: ids for name, ids in owned.items() if ids}  # children with parameters, in attribute order
    trained: list[str] = []
    for index, optimizer in enumerate(optimizers):
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        matches = [name for name, ids in owned.items() if ids == params]
        if len(matches) != 1 or matches[0] in trained:
            raise DeepSpeedConfigError(
                f"Optimizer {index} from {where} does not train exactly the parameters of one attribute of "
                f"{type(module).__name__} (its children with parameters: {', '.join(owned) or 'none'}), so the "
                "models to give one engine each cannot be inferred"
            )
        trained.append(matches[0])
    covered = set().union(*owned.values())
    loose = [name for name, p in module.named_parameters() if id(p) not in covered]
    if loose:
        raise DeepSpeedConfigError(
            f"{type(module).__name__} has parameters of its own outside its child modules ({', '.join(loose[:3])}), "
            "so the models to give one engine each cannot be inferred"
        )
    return trained + [name for name in owned if name not in trained]


def route_forward(module: nn.Module, engine: Callable[..., Any]) -> Callable[[], None]:
    """Make calls of ``module`` (``self.generator(z)`` in a training step) run ``engine``'s forward, which calls the
    module's own forward once inside; returns the function that undoes it.

    DeepSpeed's engine forward prepares the backward of what it returns (gradient accumulation scaling, ZeRO's
    backward prologue); the module keeps its attributes and state-dict names."""
    own = module.__dict__.get("forward")
    original = module.forward
    inside = [False]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if inside[0]:  # the engine calling the module
            return original(*args, **kwargs)
        inside[0] = True
        try:
            return engine(*args, **kwargs)
        finally:
            inside[0] = False

    module.forward = forward

    def undo() -> None:
        if own is not None:
            module.forward = own
        else:
            module.__dict__.pop("forward", None)

    return undo


def parameters_reached(loss: torch.Tensor) -> set[int]:
    """The ids of the leaf tensors (parameters) whose gradients a backward of ``loss`` would accumulate."""
    found: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def engine_for_backward(loss: torch.Tensor, trained: Mapping[str, tuple[Any, Iterable[nn.Parameter]]]) -> Any:
    """The engine whose model's trainable parameters ``loss`` reaches (``trained``: name -> (engine, parameters)).

    Exactly one must be reached: a loss reaching two trained models would need two engines' backward at once (freeze
    the other with ``toggle_optimizer`` or ``detach()`` its input); one reaching none trains nothing."""
    reached = parameters_reached(loss)
    hits = [name for name, (_, params) in trained.items() if any(id(p) in reached for p in params if p.requires_grad)]
    if len(hits) == 1:
        return trained[hits[0]][0]
    if not hits:
        raise DeepSpeedConfigError(
            "The loss passed to backward reaches no trainable parameter of the models with an optimizer "
            f"({', '.join(trained)}): nothing would be trained. Compute it from a trained model's output."
        )
    raise DeepSpeedConfigError(
        f"The loss passed to backward reaches trainable parameters of {' and '.join(map(repr, hits))}, which have "
        "their own engines. Back-propagate into one model at a time: freeze the others for this loss "
        "(`self.toggle_optimizer(opt)` in a LightningModule, `requires_grad_(False)`) or `detach()` their outputs."
    )


def model_dtype_for(config: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype DeepSpeed keeps a model's weights in under ``config`` (None: fp32), for models without an engine."""
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if (config.get(key) or {}).get("enabled") is True:
            return dtype
    return None


def without_training_sections(config: Mapping[str, Any]) -> dict[str, Any]:
    """A model's config for an inference-only engine (a frozen model under ZeRO-3): no optimizer, scheduler or
    offloaded optimizer."""
    frozen = {k: v for k, v in config.items() if k not in ("optimizer", "scheduler")}
    zero = dict(frozen.get("zero_optimization") or {})
    zero.pop("offload_optimizer", None)
    frozen["zero_optimization"] = zero
    return frozen
