"""Every public argument is documented where the API reference (docs/reference/, generated from the docstrings by
mkdocstrings) shows it: each parameter of a public class or function (``lightspeed.strategies``, ``lightspeed.fabric``,
``lightspeed.callbacks``, ``lightspeed.export``, ``lightspeed.plugins``, ``lightspeed.xla`` and the functions of
``lightspeed``) has its own entry in the docstring's ``Args:`` section (``Attributes:`` for the result dataclasses).

A class that takes ``*args``/``**kwargs`` shows only those in its signature, so its entry for them must name every
keyword they stand for: the arguments of the class it hands them to (:data:`FORWARDS`) and of lightspeed's mixins
in between; or, for ``**arguments: Unpack[SomeTypedDict]`` (PEP 692, how the ZeRO strategies declare their arguments
once for every front end), name the typed dict, which documents each of its keys. Every public class and function,
and every such typed dict, is on a reference page."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.accelerators import XLAAccelerator as LightningXLAAccelerator
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceXLAStrategy, XLAStrategy

import lightspeed
from _support.launch import REPO_ROOT
from lightspeed.core.zero.config.keywords import unpacked_typed_dict

MODULES = ("strategies", "fabric", "callbacks", "export", "plugins", "xla")
_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Keyword Args|Other Parameters|Attributes):\s*$")
_ENTRY = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?:(?:\s|$)")


def _public() -> list[tuple[str, Any]]:
    """``(dotted name, object)`` of every public class (not an exception or warning) and function."""
    found = []
    for module_name in MODULES:
        module = getattr(lightspeed, module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj) or (inspect.isclass(obj) and not issubclass(obj, BaseException | Warning)):
                found.append((f"lightspeed.{module_name}.{name}", obj))
    functions = [name for name in lightspeed.__all__ if inspect.isfunction(getattr(lightspeed, name))]
    found += [(f"lightspeed.{name}", getattr(lightspeed, name)) for name in functions]
    return found


#: the public classes with ``*args``/``**kwargs`` -> the class those go to (their keywords must be listed)
FORWARDS: dict[str, type] = {
    "lightspeed.strategies.DDPExactStrategy": DDPStrategy,
    "lightspeed.strategies.XLAExactStrategy": XLAStrategy,
    "lightspeed.fabric.DDPExactFabricStrategy": FabricDDPStrategy,
    "lightspeed.plugins.XLAAccelerator": LightningXLAAccelerator,
}


def _docstrings(obj: Any) -> str:
    texts = [inspect.getdoc(obj) or ""]
    if inspect.isclass(obj) and "__init__" in vars(obj) and vars(obj)["__init__"].__doc__:
        texts.append(inspect.cleandoc(vars(obj)["__init__"].__doc__))
    return "\n".join(texts)


def documented(obj: Any) -> dict[str, str]:
    """The entries of the docstring's argument sections: name (``*args``/``**kwargs`` with their stars) -> text.

    Google style, as mkdocstrings reads it: one ``name:`` or ``name (type):`` per entry at the section's first
    indentation, continuation lines indented further."""
    entries: dict[str, str] = {}
    section_indent: int | None = None
    entry_indent: int | None = None
    current: str | None = None
    for line in _docstrings(obj).splitlines():
        header = _SECTION.match(line)
        if header:
            section_indent, entry_indent, current = len(header.group(1)), None, None
            continue
        if section_indent is None or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= section_indent:  # the section ended
            section_indent, current = None, None
            continue
        if entry_indent is None:
            entry_indent = indent
        if indent == entry_indent:
            match = _ENTRY.match(line.strip())
            current = match.group(1) if match else None
            if current is not None:
                entries[current] = line.strip()[match.end() :] if match else ""
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


def _named(parameters: Any) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [name for name, p in parameters.items() if p.kind in kinds and name != "self"]


def forwarded_keywords(name: str, cls: type) -> set[str]:
    """The keywords that ``cls``'s ``*args``/``**kwargs`` stand for: those of lightspeed's classes in its MRO and of
    the class they go to."""
    own = set(_named(inspect.signature(cls).parameters))
    keywords: set[str] = set()
    for base in cls.__mro__[1:]:
        if base.__module__.startswith("lightspeed.") and "__init__" in vars(base):
            keywords |= set(_named(inspect.signature(vars(base)["__init__"]).parameters))
    target = FORWARDS[name]
    keywords |= set(_named(inspect.signature(target).parameters))
    return keywords - own


@pytest.mark.parametrize(("name", "obj"), _public(), ids=[name for name, _ in _public()])
def test_every_public_argument_has_an_entry_in_the_docstring(name: str, obj: Callable[..., Any]) -> None:
    parameters = inspect.signature(obj).parameters
    entries = documented(obj)
    missing = []
    for parameter in parameters.values():
        stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "")
        if f"{stars}{parameter.name}" not in entries and parameter.name != "self":
            missing.append(f"{stars}{parameter.name}")
    assert not missing, f"{name}: no `Args:` entry for {missing} (documented: {sorted(entries)})"
    unknown = [entry for entry in entries if entry.lstrip("*") not in parameters]
    if dataclasses.is_dataclass(obj):
        unknown = [entry for entry in unknown if entry not in {f.name for f in dataclasses.fields(obj)}]
    assert not unknown, f"{name}: `Args:` entries for what the signature does not have: {unknown}"


@pytest.mark.parametrize("name", sorted(FORWARDS))
def test_args_and_kwargs_entries_name_every_keyword_they_stand_for(name: str) -> None:
    cls = dict(_public())[name]
    kinds = {p.kind for p in inspect.signature(cls).parameters.values()}
    assert kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}, f"{name} takes no **kwargs"
    entries = documented(cls)
    listed = " ".join(text for entry, text in entries.items() if entry.startswith("*"))
    unnamed = sorted(k for k in forwarded_keywords(name, cls) if f"``{k}``" not in listed and k not in entries)
    assert not unnamed, f"{name}: its *args/**kwargs entries do not name {unnamed}"


def _typed_kwargs(obj: Any) -> type | None:
    """The typed dict of ``obj``'s ``**name: Unpack[...]``, else None."""
    function = obj.__init__ if inspect.isclass(obj) else obj
    for parameter in inspect.signature(obj).parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            return unpacked_typed_dict(function, parameter.name)
    return None


def _typed_dicts() -> dict[str, type]:
    """``dotted name -> typed dict`` of every public class's ``**name: Unpack[...]``, and of the typed dicts those
    are built from."""
    found: dict[str, type] = {}
    pending = [typed for _, obj in _public() if (typed := _typed_kwargs(obj)) is not None]
    while pending:
        typed = pending.pop()
        found[f"{typed.__module__}.{typed.__qualname__}"] = typed
        pending += [base for base in getattr(typed, "__orig_bases__", ()) if hasattr(base, "__annotations__")]
    return found


def test_every_public_class_with_var_arguments_says_where_they_go() -> None:
    var = {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
    forwarding = {
        name
        for name, obj in _public()
        if inspect.isclass(obj) and {p.kind for p in inspect.signature(obj).parameters.values()} & var
    }
    typed = {name for name, obj in _public() if _typed_kwargs(obj) is not None}
    assert {"lightspeed.strategies.ZeroStrategy", "lightspeed.fabric.ZeroAutoFabricStrategy"} <= typed
    assert forwarding - set(FORWARDS) == typed


@pytest.mark.parametrize("name", sorted(n for n, obj in _public() if _typed_kwargs(obj) is not None))
def test_typed_kwargs_entries_name_their_typed_dict(name: str) -> None:
    obj = dict(_public())[name]
    typed = _typed_kwargs(obj)
    assert typed is not None
    entries = documented(obj)
    listed = " ".join(text for entry, text in entries.items() if entry.startswith("**"))
    assert typed.__name__ in listed, f"{name}: its **kwargs entry does not name {typed.__name__}"


def _public_typed_dicts() -> list[str]:
    return sorted(name for name in _typed_dicts() if not name.rsplit(".", 1)[1].startswith("_"))


@pytest.mark.parametrize("name", _public_typed_dicts())
def test_every_key_of_a_typed_kwargs_dict_is_documented(name: str) -> None:
    """In its own ``Attributes:`` or in those of the typed dicts it is built from."""
    typed = _typed_dicts()[name]
    keys = set(typed.__annotations__)
    everywhere = set().union(*(documented(t) for t in _typed_dicts().values() if set(t.__annotations__) <= keys))
    assert keys <= everywhere, f"{name}: keys documented nowhere: {sorted(keys - everywhere)}"


def test_every_public_class_and_function_is_on_a_reference_page() -> None:
    pages = "\n".join(path.read_text() for path in sorted((REPO_ROOT / "docs" / "reference").glob("*.md")))
    directives = set(re.findall(r"^::: (\S+)$", pages, re.MULTILINE))
    missing = [name for name, _ in _public() if name not in directives]
    missing += [name for name in _public_typed_dicts() if name not in directives]
    assert not missing, f"no `::: name` on a docs/reference page for {missing}"


@pytest.mark.parametrize(
    ("name", "lightning"),
    [
        ("XLAExactStrategy", XLAStrategy),
        ("SingleDeviceXLAExactStrategy", SingleDeviceXLAStrategy),
    ],
)
def test_the_xla_strategies_show_their_real_signatures(name: str, lightning: type) -> None:
    """Every named argument of Lightning's strategy, in its order, and lightspeed's own, keyword-only."""
    params = inspect.signature(getattr(lightspeed.strategies, name)).parameters
    theirs = [p for p, v in inspect.signature(lightning).parameters.items() if v.kind is v.POSITIONAL_OR_KEYWORD]
    assert [p for p, v in params.items() if v.kind is v.POSITIONAL_OR_KEYWORD] == theirs
    own = {p for p, v in params.items() if v.kind is v.KEYWORD_ONLY}
    assert own == {"sync_with_dataloader", "recompilation_alarm", "recompilation_warmup_steps"}
