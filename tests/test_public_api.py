"""The public API is one vocabulary: each public module's ``__all__`` lists what users need and nothing internal.

The rule, checked below: a name in the ``__all__`` of a public module (:data:`PUBLIC_MODULES`) that comes from
``lightspeed.core`` (an object whose ``__module__`` is in ``lightspeed.core``, or a name the module imports with
``from lightspeed.core... import``) must be one of :data:`CORE_REEXPORTS`, each of which the docs (README.md,
docs/*.md) or the public module's own docstring name; ``lightspeed.errors`` hands out core's exceptions and is the
only public ``__all__`` with exception classes (warning categories aside); no public ``__all__`` lists a
registration function, a mixin or a private name. Names taken out of a public ``__all__`` still work where users
wrote them, with a ``FutureWarning`` that names the new spelling.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

import lightspeed
from lightspeed.core import errors as core_errors
from lightspeed.core.zero.config.keywords import named_arguments

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "lightspeed"
DOCS = "\n".join(path.read_text() for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])

PUBLIC_MODULES = (
    "lightspeed",
    "lightspeed.strategies",
    "lightspeed.fabric",
    "lightspeed.plugins",
    "lightspeed.callbacks",
    "lightspeed.export",
    "lightspeed.xla",
    "lightspeed.errors",
)

#: public module -> the names of its ``__all__`` that come from ``lightspeed.core`` (besides ``lightspeed.errors``,
#: which is core's list of exceptions)
CORE_REEXPORTS: dict[str, set[str]] = {
    "lightspeed": {
        "exact_metrics",
        "gather_for_metrics",
        "gather_object",
        "gathered_for_evaluation",
        "gathered_for_generation",
        "load_pretrained",
        "pad_across_processes",
        "shard_iterable",
        "track",
    },
    "lightspeed.export": {"ExportResult", "LoadResult"},  # what export_checkpoint and load_exported return
    "lightspeed.xla": {
        "DEFAULT_BUCKETS",
        "DEFAULT_PAD_VALUES",
        "DEFAULT_WARMUP_STEPS",
        "RecompilationAlarm",
        "XLARecompilationWarning",
        "bucket_collate",
        "pad_to_bucket",
    },
}

#: (public module, old name) -> (the new spelling the warning names, the object the new spelling reaches)
MOVED: dict[tuple[str, str], tuple[str, str]] = {
    ("lightspeed", "GatherError"): ("lightspeed.errors.GatherError", "lightspeed.core.errors:GatherError"),
    ("lightspeed.callbacks", "StepOutputError"): (
        "lightspeed.errors.StepOutputError",
        "lightspeed.core.errors:StepOutputError",
    ),
    ("lightspeed.export", "CheckpointError"): (
        "lightspeed.errors.CheckpointError",
        "lightspeed.core.errors:CheckpointError",
    ),
    ("lightspeed.export", "ExportError"): ("lightspeed.errors.ExportError", "lightspeed.core.errors:ExportError"),
    ("lightspeed.fabric", "AccumulationStep"): (
        "lightspeed.fabric.exact_accumulation.AccumulationStep",
        "lightspeed.fabric.exact_accumulation:AccumulationStep",
    ),
    ("lightspeed.fabric", "register_fabric_strategies"): (
        "lightspeed.fabric.registration.register_fabric_strategies",
        "lightspeed.fabric.registration:register_fabric_strategies",
    ),
    ("lightspeed.strategies", "register_trainer_strategies"): (
        "lightspeed.strategies.registration.register_trainer_strategies",
        "lightspeed.strategies.registration:register_trainer_strategies",
    ),
    ("lightspeed.errors", "CallSiteMismatch"): (
        "lightspeed.errors.CallSiteMismatchError",
        "lightspeed.core.errors:CallSiteMismatchError",
    ),
}


def _source(module: str) -> Path:
    path = PACKAGE.joinpath(*module.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imported_from_core(module: str) -> set[str]:
    """The names ``module`` binds with ``from lightspeed.core... import name`` (constants have no ``__module__``)."""
    tree = ast.parse(_source(module).read_text())
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightspeed.core")
        for alias in node.names
    }


def _from_core(module: str) -> set[str]:
    """The names of ``module.__all__`` that come from ``lightspeed.core``."""
    public = importlib.import_module(module)
    imported = _imported_from_core(module)
    return {
        name
        for name in public.__all__
        if name in imported or getattr(getattr(public, name), "__module__", "").startswith("lightspeed.core")
    }


def _object(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def test_the_source_of_every_public_module_is_found() -> None:
    for module in PUBLIC_MODULES:
        assert _source(module).is_file(), module
    assert "GatherForMetrics" in lightspeed.callbacks.__all__


def test_the_public_all_lists_hold_no_core_name_but_the_documented_reexports() -> None:
    found = {module: _from_core(module) for module in PUBLIC_MODULES if module != "lightspeed.errors"}
    assert {module: names for module, names in found.items() if names} == CORE_REEXPORTS
    assert lightspeed.errors.__all__ == core_errors.__all__  # the exceptions: core's own list, handed out whole


@pytest.mark.parametrize(("module", "name"), sorted((m, n) for m, names in CORE_REEXPORTS.items() for n in names))
def test_every_core_reexport_is_documented(module: str, name: str) -> None:
    named = re.compile(rf"\b{name}\b")
    assert named.search(DOCS) or named.search(importlib.import_module(module).__doc__ or ""), f"{module}.{name}"


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_only_lightspeed_errors_lists_exceptions(module: str) -> None:
    public = importlib.import_module(module)
    values = {name: getattr(public, name) for name in public.__all__}
    exceptions = {  # warning categories (lightspeed.xla.XLARecompilationWarning) are no errors
        name
        for name, value in values.items()
        if inspect.isclass(value) and issubclass(value, BaseException) and not issubclass(value, Warning)
    }
    if module == "lightspeed.errors":
        assert exceptions == set(core_errors.__all__)
    else:
        assert exceptions == set(), module


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_no_registration_function_mixin_or_private_name_is_public(module: str) -> None:
    public = importlib.import_module(module)
    internal = [
        name
        for name in public.__all__
        if name.startswith("register") or name.endswith("Mixin") or (name.startswith("_") and name != "__version__")
    ]
    assert internal == []
    assert all(hasattr(public, name) for name in public.__all__)


@pytest.mark.parametrize(("module", "name"), sorted(MOVED), ids=lambda value: value)
def test_a_name_taken_out_of_a_public_module_still_works_with_a_warning(module: str, name: str) -> None:
    new, target = MOVED[module, name]
    public = importlib.import_module(module)
    assert name not in public.__all__
    expected = _object(target)
    with pytest.warns(FutureWarning, match=rf"{module}\.{name} is deprecated .*use {new.split(' ')[0]}") as caught:
        assert getattr(public, name) is expected
    assert caught[0].filename == __file__  # the warning names the user's line
    with pytest.warns(FutureWarning):
        imported = getattr(importlib.import_module(module), name)
    assert imported is expected


def test_from_import_of_an_old_name_works_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match=r"lightspeed\.GatherError is deprecated .*lightspeed\.errors\.GatherError"):
        from lightspeed import GatherError
    with pytest.warns(FutureWarning, match=r"lightspeed\.export\.ExportError"):
        from lightspeed.export import ExportError
    with pytest.warns(FutureWarning, match=r"lightspeed\.fabric\.register_fabric_strategies"):
        from lightspeed.fabric import register_fabric_strategies
    assert GatherError is core_errors.GatherError and ExportError is core_errors.ExportError
    register_fabric_strategies()  # still registers (idempotent)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_other_missing_names_are_still_attribute_errors(module: str) -> None:
    public = importlib.import_module(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning on the way
        with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
            public.no_such_name  # noqa: B018
        assert not hasattr(public, "no_such_name")


def test_the_public_api_imports_without_a_warning() -> None:
    """``from lightspeed.x import *`` and reading every public name never meets a deprecated one."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for module in PUBLIC_MODULES:
            public = importlib.import_module(module)
            namespace: dict[str, Any] = {}
            exec(f"from {module} import *", namespace)  # noqa: S102 - the star import users may write
            assert set(public.__all__) <= set(namespace)


# ------------------------------------------------------------------------------------------------ renamed keywords
def _export_options(monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> Any:
    """The options ``export_checkpoint(**kwargs)`` hands to the exporter (which is not run)."""
    from lightspeed import export

    seen = []
    monkeypatch.setattr(export, "export_checkpoint_path", lambda ckpt, out, options, progress: seen.append(options))
    export.export_checkpoint("ckpt", "out", **kwargs)
    return seen[0]


def test_export_checkpoint_takes_the_strategies_spelling_of_exclude_frozen_parameters(monkeypatch) -> None:
    """``exclude_frozen_parameters`` as ``ZeroStrategy(exclude_frozen_parameters=...)`` spells it; the old
    ``exclude_frozen`` works with a FutureWarning pointing at the caller."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert _export_options(monkeypatch).exclude_frozen_parameters is False
        assert _export_options(monkeypatch, exclude_frozen_parameters=True).exclude_frozen_parameters is True
    for value in (True, False):
        with pytest.warns(
            FutureWarning,
            match=r"export_checkpoint\(exclude_frozen=\.\.\.\) is deprecated .*use exclude_frozen_parameters=",
        ) as caught:
            assert _export_options(monkeypatch, exclude_frozen=value).exclude_frozen_parameters is value
        assert caught[0].filename == __file__  # the line that called export_checkpoint
    with pytest.warns(FutureWarning), pytest.raises(TypeError, match="pass exclude_frozen_parameters only"):
        _export_options(monkeypatch, exclude_frozen=False, exclude_frozen_parameters=True)
    with pytest.warns(FutureWarning):  # the same value twice is no conflict
        assert _export_options(
            monkeypatch, exclude_frozen=True, exclude_frozen_parameters=True
        ).exclude_frozen_parameters


def test_zero_export_takes_the_strategies_spelling_of_exclude_frozen_parameters(tmp_path: Path) -> None:
    from lightspeed.callbacks import ZeroExport
    from lightspeed.strategies import ZeroStrategy

    assert "exclude_frozen_parameters" in named_arguments(ZeroStrategy)  # the spelling followed
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert ZeroExport(tmp_path).options.exclude_frozen_parameters is False
        assert ZeroExport(tmp_path, exclude_frozen_parameters=True).options.exclude_frozen_parameters is True
        assert ZeroExport(tmp_path, "fp32", "5GB", True).options.exclude_frozen_parameters is True  # same position
    with pytest.warns(FutureWarning, match=r"ZeroExport\(exclude_frozen=\.\.\.\) is deprecated") as caught:
        assert ZeroExport(tmp_path, exclude_frozen=True).options.exclude_frozen_parameters is True
    assert caught[0].filename == __file__
