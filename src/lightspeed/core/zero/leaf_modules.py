"""ZeRO-3 leaf modules: mixture-of-experts blocks whose parameters are gathered whole when the block is called.

ZeRO-3 gathers a module's partitioned parameters when the module is called, a collective every rank must make in the
same order. A mixture-of-experts block calls only the experts its router picked for this rank's tokens, so ranks
that route differently gather different experts, and the run fails at the first such step ("Detected a disagreement
on list contents between rank0 and rank1", a lost rank) or hangs (DeepSpeed#7461). DeepSpeed's remedy is a leaf
module (``deepspeed.utils.set_z3_leaf_modules``): all of its parameters are gathered when it is entered, its
children get no hooks of their own, and its backward hook gives the experts no token reached a zero gradient, so
every rank reduces the same gradients. The flag must be set before ``deepspeed.initialize``, which reads it while
hooking the model.

:class:`LeafModules` is the strategies' ``leaf_modules=`` argument, checked: ``"auto"`` (the default) marks the
blocks :func:`moe_blocks` finds (a module with an ``nn.ModuleList``/``nn.ModuleDict`` child named ``experts``, as
HuggingFace's Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek and Switch Transformers blocks have); a collection of
module classes, class names or module-name suffixes marks exactly those; ``None`` marks nothing. Only ZeRO-3
configs are marked. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from lightspeed.core.common.checks import module_class_problems
from lightspeed.core.common.distributed import global_rank
from lightspeed.core.common.logs import logger
from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config import AUTO, config_stage

__all__ = ["LeafEntry", "LeafModules", "find_leaf_modules", "moe_blocks"]

#: one ``leaf_modules`` entry: a module class, or a string naming a class or the end of a module's name
LeafEntry = type[nn.Module] | str

#: the child a mixture-of-experts block keeps its experts in
EXPERTS_ATTRIBUTE = "experts"

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
_EXAMPLE = "e.g. leaf_modules={MoeBlock}, leaf_modules=['Qwen3MoeSparseMoeBlock'] or leaf_modules=['mlp']"


def moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The mixture-of-experts blocks of ``model`` by name: modules with an ``nn.ModuleList``/``nn.ModuleDict`` child
    named ``experts`` (outermost ones only: a leaf module's descendants are part of it)."""
    return _outermost(
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module._modules.get(EXPERTS_ATTRIBUTE), _CONTAINERS)
    )


def _outermost(named: Iterable[tuple[str, nn.Module]]) -> dict[str, nn.Module]:
    """``named`` (in ``named_modules`` order) without the modules inside an earlier one."""
    kept: dict[str, nn.Module] = {}
    for name, module in named:
        if not any(parent == "" or name.startswith(parent + ".") for parent in kept):
            kept[name] = module
    return kept


def _matches(entry: LeafEntry, name: str, module: nn.Module) -> bool:
    """Whether ``entry`` names ``module`` (called ``name`` in the model): an instance of the class, the class's name
    or dotted path, or a module name that ends with the entry at a dot."""
    if isinstance(entry, type):
        return isinstance(module, entry)
    cls = type(module)
    if entry in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"):
        return True
    return name == entry or name.endswith("." + entry)


def find_leaf_modules(model: nn.Module, entries: Iterable[LeafEntry]) -> tuple[dict[str, nn.Module], list[LeafEntry]]:
    """The modules of ``model`` the ``entries`` name (outermost ones, by name) and the entries that name none.

    An entry naming an ``nn.ModuleList``/``nn.ModuleDict`` is refused: a container is never called, so ZeRO-3 would
    wait for its backward hook forever."""
    entries = list(entries)
    named = list(model.named_modules())
    unmatched = [entry for entry in entries if not any(_matches(entry, name, module) for name, module in named)]
    chosen = [(name, module) for name, module in named if any(_matches(entry, name, module) for entry in entries)]
    containers = [(name, module) for name, module in chosen if isinstance(module, _CONTAINERS)]
    if containers:
        name, module = containers[0]
        parent = name.rpartition(".")[0]
        parent_class = type(model.get_submodule(parent)).__name__
        raise DeepSpeedConfigError(
            f"leaf_modules names {type(module).__name__} `{name}`, a container that is never called itself, so ZeRO-3 "
            f"would wait for its backward forever. Name the module that calls its entries: its parent "
            f"`{parent or '(the model)'}` ({parent_class}), e.g. leaf_modules={{{parent_class}}}."
        )
    return _outermost(chosen), unmatched


def _describe(entry: LeafEntry) -> str:
    return entry.__qualname__ if isinstance(entry, type) else repr(entry)


def _not_a_leaf_name(entry: Any) -> str | None:
    """What is wrong with an entry that is not a class: None for a non-empty string (a class or module name)."""
    if isinstance(entry, str):
        return "an empty string" if not entry.strip() else None
    return f"{entry!r} (of type {type(entry).__name__})"


def _checked_entries(value: Any) -> tuple[LeafEntry, ...]:
    """``leaf_modules`` (not ``"auto"`` or None) as a tuple of entries; anything but module classes and non-empty
    strings raises :class:`DeepSpeedConfigError` saying what to pass."""
    if isinstance(value, (type, str)):
        value = [value]
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise DeepSpeedConfigError(
            f"leaf_modules must be 'auto', None or a collection of module classes, class names or module-name "
            f"suffixes, got {value!r} ({type(value).__name__}); {_EXAMPLE}."
        )
    entries, problems = module_class_problems(value, "one leaf", _not_a_leaf_name)
    if problems:
        raise DeepSpeedConfigError(
            f"leaf_modules holds entries that name no module: {'; '.join(problems)}. Pass module classes, class "
            f"names or module-name suffixes, {_EXAMPLE}."
        )
    return tuple(dict.fromkeys(entries))


class LeafModules:
    """The ``leaf_modules=`` argument of a ZeRO strategy, checked (:meth:`of`), and the marking of a model's ZeRO-3
    leaf modules before its engine is built (:meth:`mark`).

    One instance serves every engine of a run: an entry must name a module of at least one of them (a model set up
    after one that has the module may lack it, as a GAN's discriminator lacks the generator's blocks)."""

    def __init__(self, entries: tuple[LeafEntry, ...] | None = None) -> None:
        #: the modules to mark (None: the mixture-of-experts blocks :func:`moe_blocks` finds)
        self.entries = entries
        self._matched: set[LeafEntry] = set()

    @classmethod
    def of(cls, value: Any) -> LeafModules:
        """The checked argument: ``"auto"`` (detect MoE blocks), None or an empty collection (mark nothing), or
        module classes, class names and module-name suffixes (mark exactly those)."""
        if isinstance(value, LeafModules):
            return value
        if isinstance(value, str) and value == AUTO:
            return cls(None)
        return cls(() if value is None else _checked_entries(value))

    @property
    def detects(self) -> bool:
        """True for ``"auto"``: the MoE blocks found are marked."""
        return self.entries is None

    def mark(self, model: nn.Module, config: Mapping[str, Any]) -> dict[str, nn.Module]:
        """Flag ``model``'s leaf modules for the ZeRO-3 engine ``config`` will build (nothing at other stages), log
        one line naming their classes (rank 0, the ``lightspeed`` logger at INFO) and return them by name. An entry
        that names no module of this model nor of an earlier one is an error naming it."""
        if config_stage(dict(config)) != 3 or self.entries == ():
            return {}
        if self.entries is None:
            found = moe_blocks(model)
        else:
            found, unmatched = find_leaf_modules(model, self.entries)
            self._matched.update(entry for entry in self.entries if entry not in unmatched)
            missing = [entry for entry in unmatched if entry not in self._matched]
            if missing:
                raise self._unmatched_error(model, missing)
        if not found:
            return {}
        from deepspeed.utils import set_z3_leaf_module

        for module in found.values():
            set_z3_leaf_module(module, True)
        if global_rank() == 0:
            logger.info(self.describe(found))
        return found

    def describe(self, found: Mapping[str, nn.Module]) -> str:
        """The log line for the leaf modules ``found``: their classes with counts, and why they are leaves."""
        counts: dict[str, int] = {}
        for module in found.values():
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
        classes = ", ".join(f"{name} x{count}" if count > 1 else name for name, count in counts.items())
        source = "mixture-of-experts blocks found" if self.detects else "leaf_modules"
        return (
            f"ZeRO-3 leaf modules ({source}: each gathered whole when called, so ranks whose tokens reach different "
            f"experts stay in step): {classes}"
        )

    @staticmethod
    def _unmatched_error(model: nn.Module, missing: list[LeafEntry]) -> DeepSpeedConfigError:
        classes = sorted({type(module).__name__ for module in model.modules()})
        shown = ", ".join(classes[:12]) + (f" and {len(classes) - 12} more" if len(classes) > 12 else "")
        listed = ", ".join(_describe(entry) for entry in missing)
        names = f"entry {listed} names" if len(missing) == 1 else f"entries {listed} name"
        return DeepSpeedConfigError(
            f"leaf_modules {names} no module of {type(model).__name__}: give a module class of the model, a class "
            f"name or the end of a module's name as `model.named_modules()` lists it ({_EXAMPLE}). The model's "
            f"module classes: {shown}."
        )
