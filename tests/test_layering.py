"""The package's layering, read from the import statements of every module under ``src/lightspeed``:

* ``core/`` knows nothing of Lightning and never imports the package root or a Lightning layer;
* ``core/`` packages import each other only downward (:data:`CORE_LEVELS`);
* ``plugins/`` never imports strategies, callbacks or the CLI; ``strategies/`` (the Trainer's front end) and
  ``fabric/`` are siblings: neither imports the other, callbacks, the CLI or the registry, and each registers its
  names in its own ``registration`` module, which only ``lightspeed.registry`` and its own package import;
* ``ray/`` (Ray Train glue over the front ends, an optional extra) is imported by no other part of the package;
* the imports form no cycle, function-level and ``TYPE_CHECKING`` imports included;
* no module outside ``tests/`` is named like a test file, and no two test files share a name (pytest imports them
  by their base name: the second one fails to collect, and with it the whole run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lightspeed"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, top_level_only: bool) -> list[tuple[int, str]]:
    """(line, imported module) for every import in ``path``; ``from X import y`` counts as ``X.y`` when that is a
    module of the package, else as ``X``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: list[tuple[int, str]] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.append((node.lineno, candidate if candidate in MODULES else node.module))
    return found


#: core/'s packages from the bottom up; a package imports only packages of a lower level (and itself)
CORE_LEVELS: dict[str, int] = {
    "errors": 0,
    "common": 0,
    "accumulation": 1,
    "gather": 1,
    "xla": 1,
    "reliability": 2,
    "peft": 2,
    "sequence_parallel": 2,
    "checkpoint": 3,
    "zero": 4,
}


def _core_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["lightspeed", "core"] else None


def test_every_core_package_has_a_level() -> None:
    packages = {_core_package(module) for module in MODULES} - {None}
    assert packages == set(CORE_LEVELS)


def _upward_imports(module: str, imports: list[tuple[int, str]]) -> list[str]:
    """The imports of core ``module`` that reach a core package of the same or a higher level."""
    package = _core_package(module)
    assert package is not None
    offending = []
    for line, name in imports:
        imported = _core_package(name)
        if imported is not None and imported != package and CORE_LEVELS[imported] >= CORE_LEVELS[package]:
            offending.append(f"line {line}: {name}")
    return offending


@pytest.mark.parametrize("module", sorted(name for name in MODULES if _core_package(name) is not None))
def test_core_packages_import_each_other_only_downward(module: str) -> None:
    assert _upward_imports(module, _imports(MODULES[module], top_level_only=False)) == []


def test_the_level_rule_finds_an_upward_import() -> None:
    imports = [(3, "lightspeed.core.errors"), (4, "lightspeed.core.zero.engine"), (5, "lightspeed.core.xla.runtime")]
    assert _upward_imports("lightspeed.core.reliability.staging", imports) == ["line 4: lightspeed.core.zero.engine"]
    assert _upward_imports("lightspeed.core.gather.api", imports) == [
        "line 4: lightspeed.core.zero.engine",
        "line 5: lightspeed.core.xla.runtime",
    ]


def test_every_module_is_found() -> None:
    assert "lightspeed.core.zero.config.zero_recipe" in MODULES and "lightspeed.registry" in MODULES


@pytest.mark.parametrize("module", sorted(name for name in MODULES if name.startswith("lightspeed.core")))
def test_core_imports_neither_lightning_nor_the_lightning_layers(module: str) -> None:
    forbidden = (
        "lightning",
        "pytorch_lightning",
        "lightspeed.strategies",
        "lightspeed.plugins",
        "lightspeed.callbacks",
        "lightspeed.cli",
        "lightspeed.registry",
        "lightspeed.export",
        "lightspeed.fabric",
        "lightspeed.ray",
    )
    offending = [
        f"line {line}: {name}"
        for line, name in _imports(MODULES[module], top_level_only=False)
        if name == "lightspeed" or any(name == f or name.startswith(f + ".") for f in forbidden)
    ]
    assert not offending, f"{module} imports {offending}"


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        (
            "lightspeed.plugins",
            (
                "lightspeed.strategies",
                "lightspeed.callbacks",
                "lightspeed.cli",
                "lightspeed.registry",
                "lightspeed.ray",
            ),
        ),
        (
            "lightspeed.strategies",
            ("lightspeed.callbacks", "lightspeed.cli", "lightspeed.registry", "lightspeed.fabric", "lightspeed.ray"),
        ),
        (
            "lightspeed.fabric",
            (
                "lightspeed.callbacks",
                "lightspeed.cli",
                "lightspeed.registry",
                "lightspeed.strategies",
                "lightspeed.ray",
            ),
        ),
        # Ray glue over the front ends (an optional extra): nothing else imports it
        ("lightspeed.ray", ("lightspeed.callbacks", "lightspeed.cli", "lightspeed.registry")),
        ("lightspeed.callbacks", ("lightspeed.ray",)),
        ("lightspeed.cli", ("lightspeed.ray",)),
    ],
)
def test_lower_layers_do_not_import_higher_ones(layer: str, forbidden: tuple[str, ...]) -> None:
    offending = [
        f"{module} line {line}: {name}"
        for module, path in MODULES.items()
        if module.startswith(layer)
        for line, name in _imports(path, top_level_only=False)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]
    assert not offending


def _owning_module(name: str) -> str | None:
    """The package module an import loads (``lightspeed.a.b`` for ``lightspeed.a.b.Thing``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def test_front_ends_register_their_names_in_sibling_modules() -> None:
    registrations = {"lightspeed.strategies.registration", "lightspeed.fabric.registration"}
    assert registrations <= set(MODULES)
    importers = {
        module
        for module, path in MODULES.items()
        for _, name in _imports(path, top_level_only=False)
        if _owning_module(name) in registrations
    }
    assert importers == {"lightspeed.registry", "lightspeed.strategies", "lightspeed.fabric"}


def test_imports_have_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = {_owning_module(name) for _, name in _imports(path, top_level_only=False)}
        graph[module] = {t for t in targets if t and t != module}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_outside_tests_is_named_like_a_test() -> None:
    assert [str(p) for p in PACKAGE.rglob("test_*.py")] == []


def test_no_two_test_files_share_a_name() -> None:
    seen: dict[str, list[str]] = {}
    for path in sorted((PACKAGE.parents[1] / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parents[1])))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
