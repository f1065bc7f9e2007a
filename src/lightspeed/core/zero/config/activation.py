"""DeepSpeed's ``activation_checkpointing`` section: built from the strategy arguments, checked, and its ``"auto"``
values resolved.

The section sets how ``deepspeed.checkpointing.checkpoint`` stores the checkpointed inputs of a block between the
forward and the backward pass (the blocks themselves are chosen by ``activation_checkpointing_policy``, see
:mod:`lightspeed.core.zero.activation_checkpointing`, or by the user's own ``deepspeed.checkpointing.checkpoint``
calls). The ``"auto"`` rules:

* ``partition_activations``: off. It splits each checkpoint across the model-parallel ranks; lightspeed trains with
  data parallelism only, so there is nothing to split across (DeepSpeed would only copy each checkpoint).
* ``contiguous_memory_optimization``: off. It copies partitioned checkpoints into preallocated buffers and so needs
  ``partition_activations`` (and ``number_checkpoints``).
* ``cpu_checkpointing``: on when ZeRO-3 offloads the parameters (to the CPU or NVMe: the run is short of device
  memory) and the engine runs on an accelerator such as CUDA, so the checkpoints wait in host memory for the backward
  pass; off otherwise, and always off on the CPU device, where they are in host memory already (``True`` is turned
  off there with a note: DeepSpeed's copy to the CPU returns the input itself and then empties it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightspeed.core.common.checks import module_class_problems
from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config.choices import AUTO

#: the section's name in the DeepSpeed config
SECTION = "activation_checkpointing"
#: the keys that may be "auto", with the value "auto" stands for when nothing decides otherwise
AUTO_KEYS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
FLAG_KEYS = ("synchronize_checkpoint_boundary", "profile")
NUMBER_KEY = "number_checkpoints"


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


#: what ``activation_checkpointing_policy`` holds once checked: the module classes whose instances are checkpointed
Policy = frozenset[type[torch.nn.Module]]

_POLICY_EXAMPLE = "e.g. activation_checkpointing_policy={Block} with the class of the model's repeated block"


def _not_a_class(entry: Any) -> str:
    return f"{entry!r} (a {type(entry).__name__}): pass the module class itself, not its name or an object"


def checked_policy(policy: Any) -> Policy | None:
    """``activation_checkpointing_policy`` as a frozenset of module classes (None: no checkpointing).

    Takes a set (or list, tuple) of ``torch.nn.Module`` subclasses, or one class. Anything else, an instance where
    a class belongs, a class that is not a module, ``torch.nn.Module`` itself (it would match the whole model), or a
    callable wrap policy as FSDP takes, raises :class:`DeepSpeedConfigError` saying what to pass instead.
    """
    if policy is None:
        return None
    if isinstance(policy, type):
        policy = {policy}
    if isinstance(policy, (str, bytes, dict)) or not isinstance(policy, (set, frozenset, list, tuple)):
        if callable(policy):
            got = f"a callable ({getattr(policy, '__qualname__', type(policy).__name__)}): wrap policies as FSDP takes "
            got += "them are not supported"
        else:
            got = f"a {type(policy).__name__} ({policy!r})"
        raise DeepSpeedConfigError(
            f"activation_checkpointing_policy must be a set of torch.nn.Module classes, got {got}. Pass the classes "
            f"whose instances' forward is checkpointed, {_POLICY_EXAMPLE}."
        )
    _, problems = module_class_problems(policy, "one checkpoint", _not_a_class)
    if problems:
        listed = "; ".join(problems)
        raise DeepSpeedConfigError(
            f"activation_checkpointing_policy holds entries that are not module classes to checkpoint: {listed}. "
            f"Pass the classes of the model's blocks, {_POLICY_EXAMPLE}."
        )
    return frozenset(policy) or None


def argument_problems(arguments: dict[str, Any]) -> list[str]:
    """What is wrong with the strategy arguments of the section (``name -> value``, the same names as its keys)."""
    return _value_problems(arguments, lambda name: name, ("True", "False", "None"))


def _value_problems(values: dict[str, Any], label: Callable[[str], str], words: tuple[str, str, str]) -> list[str]:
    """Bad values among the section's keys in ``values``, each named by ``label`` and spelled with ``words`` (true,
    false and none as the user writes them: Python arguments or JSON)."""
    yes, no, none = words
    problems = []
    for key in AUTO_KEYS:
        value = values.get(key, AUTO)
        if not (isinstance(value, bool) or value == AUTO):
            problems.append(f'{label(key)} must be {yes}, {no} or "auto", got {value!r}.')
    for key in FLAG_KEYS:
        value = values.get(key, False)
        if not isinstance(value, bool):
            problems.append(f"{label(key)} must be {yes} or {no}, got {value!r}.")
    number = values.get(NUMBER_KEY)
    if number is not None and not _is_count(number):
        problems.append(
            f"{label(NUMBER_KEY)} must be {none} or a whole number >= 1 (the checkpointed blocks in one forward "
            f"pass), got {number!r}."
        )
    return problems


def build_section(arguments: dict[str, Any], checkpointing: bool) -> dict[str, Any] | None:
    """The preset's section for the strategy arguments (checked beforehand), or None when nothing asks for it:
    ``checkpointing`` is False (no ``activation_checkpointing_policy``) and every argument has its default."""
    defaults = {**dict.fromkeys(AUTO_KEYS, AUTO), **dict.fromkeys(FLAG_KEYS, False), NUMBER_KEY: None}
    values = {name: arguments.get(name, default) for name, default in defaults.items()}
    if not checkpointing and values == defaults:
        return None
    section = {name: values[name] for name in (*AUTO_KEYS, *FLAG_KEYS)}
    if values[NUMBER_KEY] is not None:
        section[NUMBER_KEY] = values[NUMBER_KEY]
    return section


def section_problems(config: dict[str, Any]) -> list[str]:
    """Bad values and contradictions in a (merged) config's section, as DeepSpeed would only find them at the first
    checkpointed forward (or never: it reads any truthy value as on)."""
    section = config.get(SECTION)
    if not isinstance(section, dict):
        return []
    problems = _value_problems(section, lambda key: f"{SECTION}.{key}", ("true", "false", "null"))
    number = section.get(NUMBER_KEY)
    if section.get("contiguous_memory_optimization") is True:
        if section.get("partition_activations") is not True:
            problems.append(
                "contiguous_memory_optimization is on, but partition_activations is "
                f"{_shown(section.get('partition_activations', False))}: DeepSpeed copies only partitioned checkpoints "
                "into its contiguous buffers. Set partition_activations=True too, or turn "
                "contiguous_memory_optimization off."
            )
        if number is None:
            problems.append(
                "contiguous_memory_optimization is on, but number_checkpoints is not set: DeepSpeed preallocates one "
                "buffer per checkpointed block. Set number_checkpoints to the number of checkpointed blocks in one "
                "forward pass."
            )
    return problems


def _shown(value: Any) -> str:
    return f'"{AUTO}" (off without model parallelism)' if value == AUTO else repr(value).lower()


def parameters_offloaded(config: dict[str, Any]) -> bool:
    """Whether the config's ZeRO-3 keeps the parameters on the CPU or NVMe."""
    zero = config.get("zero_optimization")
    offload = zero.get("offload_param") if isinstance(zero, dict) else None
    return isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme")


def resolve_section(section: dict[str, Any], offloaded: bool, device: Callable[[], str]) -> list[str]:
    """Fill the section's ``"auto"`` values in place (see the module's rules); returns notes about settings that have
    no effect here. ``device`` is a function returning the device kind (``"cuda"``, ``"cpu"``, ...), called only
    when the answer matters."""
    notes = []
    for key in ("partition_activations", "contiguous_memory_optimization"):
        if section.get(key) == AUTO:
            section[key] = False
    if section.get("cpu_checkpointing") == AUTO:
        section["cpu_checkpointing"] = bool(offloaded and device() != "cpu")
    elif section.get("cpu_checkpointing") is True and device() == "cpu":
        # DeepSpeed "copies" each checkpointed input to the CPU, gets the same tensor back there, then empties it
        section["cpu_checkpointing"] = False
        notes.append(
            "activation_checkpointing.cpu_checkpointing has no effect on the CPU device (the checkpoints are in host "
            "memory already) and DeepSpeed's copy would empty the checkpointed inputs there: turned off."
        )
    if section.get("partition_activations") is True:
        notes.append(
            "activation_checkpointing.partition_activations splits checkpoints across model-parallel ranks; "
            "lightspeed trains without model parallelism, so each rank keeps whole checkpoints (DeepSpeed only copies "
            "them)."
        )
    return notes
