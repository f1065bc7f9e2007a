"""Activation checkpointing without editing the model: ``activation_checkpointing_policy={Block}`` runs the forward of
every ``Block`` of the model under ``deepspeed.checkpointing.checkpoint``, which keeps only the block's inputs for the
backward pass and runs the forward again there; DeepSpeed's ``activation_checkpointing`` section (see
:mod:`lightspeed.core.zero.config.activation`) sets where those inputs wait.

Each front end applies the policy to the model before the DeepSpeed engine is built (:func:`apply_policy`) and
configures DeepSpeed's checkpointing from the resolved config once the engine exists
(:func:`configure_deepspeed_checkpointing`). No Lightning.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config.activation import SECTION, Policy

__all__ = ["CheckpointedForward", "apply_policy", "configure_deepspeed_checkpointing", "checkpointed_modules"]


class CheckpointedForward:
    """Set as a module's ``forward``: runs the class's ``forward`` under ``deepspeed.checkpointing.checkpoint`` while
    gradients are recorded (plain otherwise: evaluation keeps nothing for a backward pass).

    The module's own ``__call__`` still runs its hooks (ZeRO-3 gathers the block's parameters there, and again before
    the recomputation in the backward pass), its class and ``state_dict`` stay as they were, and ``copy.deepcopy`` of
    the model gives a copy that checkpoints itself. Inputs and outputs may be any nesting of tuples, lists and dicts
    (an output is flattened for DeepSpeed, which checkpoints tensors and tuples of them, and rebuilt afterwards). An
    empty HuggingFace KV cache among the keyword arguments is left out (see :func:`_without_kv_cache`).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward.__get__(self.module)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        from deepspeed import checkpointing  # looked up per call, so it is DeepSpeed's current function

        kwargs = _without_kv_cache(type(self.module).__qualname__, kwargs)

        structure: list[_pytree.TreeSpec] = []

        def flat_forward(_grad_anchor: torch.Tensor, *inner_args: Any, **inner_kwargs: Any) -> tuple[Any, ...]:
            leaves, spec = _pytree.tree_flatten(forward(*inner_args, **inner_kwargs))
            structure[:] = [spec]
            return tuple(leaves)

        # DeepSpeed's checkpoint is reentrant: its outputs need a gradient only when one of its inputs has one. The
        # first block often gets inputs that have none (token ids, the batch itself), so an anchor that does makes
        # the block's parameters receive their gradients in every position.
        anchor = torch.ones(1, requires_grad=True)
        leaves = checkpointing.checkpoint(flat_forward, anchor, *args, **kwargs)
        if not isinstance(leaves, tuple):
            leaves = (leaves,)
        return _pytree.tree_unflatten(list(leaves), structure[0])


#: the keyword arguments HuggingFace layers take their KV cache in (``cache`` in transformers 5)
KV_CACHE_KEYS = ("cache", "past_key_values", "past_key_value")


def _without_kv_cache(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without an empty KV cache. HuggingFace models build one in training too (``use_cache`` defaults to
    True) and each attention layer appends its keys to it: run twice, a checkpointed layer would find its own keys
    there when recomputed and attend to them again (the gradients silently wrong). A cache that already holds
    positions (prefix tuning) cannot be run twice either: refused."""
    for key in KV_CACHE_KEYS:
        cache: Any = kwargs.get(key)
        if not hasattr(cache, "get_seq_length"):  # not a HuggingFace cache (None, or another kind of argument)
            continue
        held = int(cache.get_seq_length())
        if held:
            raise DeepSpeedConfigError(
                f"activation_checkpointing_policy runs {name} twice (its forward again in the backward pass), and it "
                f"is given a KV cache that already holds {held} positions (prefix tuning, or a prompt run before): "
                f"the second run would find its own keys in the cache. Train without a prefilled cache, or leave "
                f"{name} out of the policy."
            )
        kwargs = {**kwargs, key: None}
    return kwargs


def checkpointed_modules(model: torch.nn.Module) -> list[str]:
    """The qualified names of ``model``'s modules whose forward runs checkpointed ("" for the model itself)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module.__dict__.get("forward"), CheckpointedForward)
    ]


def apply_policy(model: torch.nn.Module, policy: Policy | None) -> str | None:
    """Checkpoint the forward of every module of ``model`` that is an instance of a class in ``policy`` (outermost
    ones only: a matching module inside another is already recomputed with it); returns a line to log, None when
    there is no policy. Applying it again changes nothing.

    A policy that matches no module raises :class:`DeepSpeedConfigError` listing the model's module classes: nothing
    would be checkpointed, which is not what the user asked for.
    """
    if not policy:
        return None
    classes = tuple(policy)
    chosen: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, classes):
            continue
        if any(name.startswith(f"{outer}.") or outer == "" for outer, _ in chosen):
            continue  # inside a checkpointed module
        chosen.append((name, module))
    if not chosen:
        names = sorted(policy, key=lambda cls: cls.__qualname__)
        present = list(dict.fromkeys(type(module).__qualname__ for module in model.modules()))
        shown = ", ".join(present[:12]) + (f" and {len(present) - 12} more" if len(present) > 12 else "")
        raise DeepSpeedConfigError(
            "activation_checkpointing_policy={"
            + ", ".join(cls.__qualname__ for cls in names)
            + f"}} matches no module of the model, so nothing would be checkpointed. The model's module classes are: "
            f"{shown}. Name the class of its repeated block (the class object itself, from the module that defines the "
            "model)."
        )
    for _, module in chosen:
        if not isinstance(module.__dict__.get("forward"), CheckpointedForward):
            if "forward" in module.__dict__:
                raise DeepSpeedConfigError(
                    f"activation_checkpointing_policy cannot checkpoint {type(module).__qualname__} module "
                    f"{_shown_name(_name_of(chosen, module))}: its instance has its own `forward` attribute, which "
                    "the policy would replace. Remove that attribute (define forward on the class), or leave the class "
                    "out of the policy and call deepspeed.checkpointing.checkpoint in the model."
                )
            module.forward = CheckpointedForward(module)
    counts: dict[str, int] = {}
    for _, module in chosen:
        counts[type(module).__qualname__] = counts.get(type(module).__qualname__, 0) + 1
    described = ", ".join(f"{count} x {name}" for name, count in counts.items())
    return f"lightspeed: activation checkpointing: the forward of {described} runs under deepspeed.checkpointing"


def _name_of(chosen: list[tuple[str, torch.nn.Module]], module: torch.nn.Module) -> str:
    return next(name for name, candidate in chosen if candidate is module)


def _shown_name(name: str) -> str:
    return f"'{name}'" if name else "(the model itself)"


def configure_deepspeed_checkpointing(config: dict[str, Any]) -> bool:
    """Configure ``deepspeed.checkpointing`` from the config's (resolved) ``activation_checkpointing`` section, every
    key of it; returns whether there was a section (without one, DeepSpeed's settings are left as they are).

    Lightning's ``_set_deepspeed_activation_checkpointing`` passes four of the six keys; DeepSpeed's ``configure``
    first resets everything to its defaults, so ``number_checkpoints`` and ``synchronize_checkpoint_boundary`` would
    be lost (and ``contiguous_memory_optimization`` would then fail DeepSpeed's check for ``number_checkpoints``).
    """
    section = config.get(SECTION)
    if not isinstance(section, dict) or not section:
        return False
    from deepspeed import checkpointing

    checkpointing.configure(
        None,
        partition_activations=section.get("partition_activations"),
        contiguous_checkpointing=section.get("contiguous_memory_optimization"),
        num_checkpoints=section.get("number_checkpoints"),
        checkpoint_in_cpu=section.get("cpu_checkpointing"),
        synchronize=section.get("synchronize_checkpoint_boundary"),
        profile=section.get("profile"),
    )
    return True
