"""Every method a lightspeed class (public or private, in any module of the package) defines over a Lightning one
carries ``@override`` (typing_extensions), so that a method Lightning renames or removes fails loudly (type checkers)
instead of silently never being called."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

import pytest

import lightspeed
from lightspeed import callbacks, fabric, plugins, strategies

PUBLIC_CLASSES = sorted(
    {
        getattr(module, name)
        for module in (strategies, plugins, callbacks, fabric)
        for name in module.__all__
        if isinstance(getattr(module, name), type)
    },
    key=lambda cls: cls.__qualname__,
)


def _every_module() -> list[Any]:
    return [
        importlib.import_module(info.name)
        for info in pkgutil.walk_packages(lightspeed.__path__, "lightspeed.")
        if not info.name.startswith("lightspeed.cli.")  # the CLI defines no Lightning subclass
    ]


#: every class defined in a lightspeed module, private ones (``_XLAForkLauncher``) included
ALL_CLASSES = sorted(
    {
        value
        for module in _every_module()
        for value in vars(module).values()
        if isinstance(value, type) and value.__module__ == module.__name__
    },
    key=lambda cls: f"{cls.__module__}.{cls.__qualname__}",
)


def _is_lightning(cls: type) -> bool:
    return cls.__module__.split(".")[0] in ("lightning", "pytorch_lightning")


def _function(attribute: Any) -> Any:
    if isinstance(attribute, (staticmethod, classmethod)):
        return attribute.__func__
    if isinstance(attribute, property):
        return attribute.fget
    return attribute


def _missing_overrides(cls: type) -> list[str]:
    mro = inspect.getmro(cls)
    lightning_bases = [base for base in mro if _is_lightning(base)]
    own = [base for base in mro if base.__module__.startswith("lightspeed.")]
    missing = []
    for base in own:
        for name, attribute in vars(base).items():
            if name.startswith("__") or not callable(_function(attribute)):
                continue
            if any(name in vars(lightning) for lightning in lightning_bases):
                if not getattr(_function(attribute), "__override__", False):
                    missing.append(f"{base.__qualname__}.{name}")
    return missing


def test_the_public_classes_are_found() -> None:
    names = {cls.__name__ for cls in PUBLIC_CLASSES}
    assert {
        "ZeroStrategy",
        "ZeroAutoStrategy",
        "DDPExactStrategy",
        "XLAAccelerator",
        "XLAPrecision",
        "GatherForMetrics",
        "ZeroExport",
        "ZeroFabricStrategy",
        "ZeroAutoFabricStrategy",
        "DDPExactFabricStrategy",
    } <= names
    assert lightspeed.strategies.ZeroStrategy in PUBLIC_CLASSES
    assert set(PUBLIC_CLASSES) <= set(ALL_CLASSES)
    assert "_XLAForkLauncher" in {cls.__name__ for cls in ALL_CLASSES}


@pytest.mark.parametrize(
    "cls", [c for c in ALL_CLASSES if any(_is_lightning(b) for b in inspect.getmro(c))], ids=lambda cls: cls.__name__
)
def test_methods_over_lightning_carry_override(cls: type) -> None:
    assert _missing_overrides(cls) == []


def test_a_missing_override_is_reported() -> None:
    from lightning.pytorch import Callback

    class Forgetful(Callback):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None: ...

    Forgetful.__module__ = "lightspeed.callbacks.example"
    assert _missing_overrides(Forgetful) == [f"{Forgetful.__qualname__}.on_fit_start"]
