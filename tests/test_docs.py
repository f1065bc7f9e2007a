"""The docs say only what the code does: every Python block of README.md and docs/*.md compiles, every `lightspeed`
command line in a shell block parses, every ``lightspeed.X`` name the docs mention exists, every keyword a Python
block passes to a lightspeed callable is one it takes, and every ``strategy="..."`` name is registered. The README's
quick start (its first Python block) runs as the whole script it claims to be: the loss goes down and the export is
written."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

import lightspeed
from _support.launch import REPO_ROOT, run_python
from lightspeed.cli.main import build_parser
from lightspeed.core.zero.config.keywords import unpacked_typed_dict

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\s*$")
_NAME = re.compile(r"\blightspeed(?:\.[A-Za-z_]\w*)+")


def _blocks(path: Path) -> list[tuple[str, int, str]]:
    """``(language, line of the opening fence, text)`` of every fenced block in ``path``."""
    blocks, language, start, lines = [], None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = _FENCE.match(line)
        if fence and language is None:
            language, start, lines = fence.group(1), number, []
        elif line.startswith("```") and language is not None:
            blocks.append((language, start, "\n".join(lines)))
            language = None
        elif language is not None:
            lines.append(line)
    return blocks


def _python_blocks() -> list[Any]:
    return [
        pytest.param(text, id=f"{path.name}:{line}")
        for path in DOCS
        for language, line, text in _blocks(path)
        if language == "python"
    ]


def _command_lines() -> list[Any]:
    """Every ``lightspeed ...`` line of the shell blocks (continuations joined, comments and ``$`` dropped)."""
    found = []
    for path in DOCS:
        for language, line, text in _blocks(path):
            if language not in ("bash", "sh", "shell", "console"):
                continue
            for command in text.replace("\\\n", " ").splitlines():
                command = re.sub(r"\s+#.*$", "", command.strip().removeprefix("$ "))
                if command.startswith("lightspeed "):
                    found.append(pytest.param(command, id=f"{path.name}:{line}:{command.split()[1]}"))
    return found


def _resolve(dotted: str) -> Any:
    """The object ``dotted`` (``lightspeed.a.b``) names: attributes, importing submodules where needed."""
    parts = dotted.split(".")
    obj: Any = lightspeed
    for index, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        obj = importlib.import_module(".".join(parts[: index + 1]))
    return obj


@pytest.mark.parametrize("text", _python_blocks())
def test_every_python_block_compiles(text: str) -> None:
    compile(text, "<docs>", "exec")


@pytest.mark.parametrize("command", _command_lines())
def test_every_lightspeed_command_line_parses(command: str) -> None:
    command = re.split(r"\s(?:>|>>|\||&&|;)\s", command)[0]  # the command itself, not what its output goes to
    arguments = shlex.split(command.replace("[", "").replace("]", ""))[1:]  # "[--tag T]": an optional part
    try:
        build_parser().parse_args(arguments)
    except SystemExit as exit:
        pytest.fail(f"`{command}` does not parse (exit {exit.code})")


def test_every_lightspeed_name_the_docs_mention_exists() -> None:
    missing = []
    for path in DOCS:
        for dotted in sorted(set(_NAME.findall(path.read_text()))):
            dotted = dotted.rstrip(".")
            try:
                _resolve(dotted)
            except (AttributeError, ImportError):
                missing.append(f"{path.name}: {dotted}")
    assert not missing, "the docs name what does not exist:\n" + "\n".join(missing)


def _lightspeed_callables(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted lightspeed name, from the block's imports."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lightspeed":
                    names[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name or "lightspeed"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightspeed":
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _keywords_taken(target: Any) -> set[str] | None:
    """The keywords ``target`` takes by name, a ``**arguments: Unpack[...]``'s typed dict's keys included; None when
    it takes any keyword (a plain ``**kwargs``)."""
    function = target.__init__ if inspect.isclass(target) else target
    taken: set[str] = set()
    for name, parameter in inspect.signature(target).parameters.items():
        if parameter.kind is not inspect.Parameter.VAR_KEYWORD:
            taken.add(name)
            continue
        typed = unpacked_typed_dict(function, name)
        if typed is None:
            return None
        taken |= set(typed.__annotations__)
    return taken


@pytest.mark.parametrize("text", _python_blocks())
def test_every_keyword_a_block_passes_to_lightspeed_is_taken(text: str) -> None:
    tree = ast.parse(text)
    imported = _lightspeed_callables(tree)
    wrong = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.keywords:
            continue
        dotted = _dotted(node.func)
        if dotted is None or dotted.split(".")[0] not in imported:
            continue
        head, _, rest = dotted.partition(".")
        target = _resolve(imported[head] + (f".{rest}" if rest else ""))
        try:
            taken = _keywords_taken(target)
        except (TypeError, ValueError):
            continue
        if taken is None:
            continue
        wrong += [f"{dotted}({k.arg}=...)" for k in node.keywords if k.arg is not None and k.arg not in taken]
    assert not wrong, "keywords the callables do not take: " + ", ".join(wrong)


def test_every_strategy_name_in_the_docs_is_registered() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    known = set(StrategyRegistry) | set(FABRIC_REGISTRY)
    unknown = []
    for path in DOCS:
        for name in sorted(set(re.findall(r"""strategy=["']([\w-]+)["']""", path.read_text()))):
            if name not in known:
                unknown.append(f"{path.name}: strategy={name!r}")
    assert not unknown, "\n".join(unknown)


def test_the_quick_start_is_a_whole_script_that_trains_and_exports(tmp_path: Path) -> None:
    python = [text for language, _, text in _blocks(REPO_ROOT / "README.md") if language == "python"]
    script = tmp_path / "quickstart.py"
    script.write_text(python[0])
    proc = run_python(script, cwd=tmp_path, timeout=300)
    losses = [float(value) for value in re.findall(r"^epoch \d+: loss ([\d.]+)$", proc.stdout, re.MULTILINE)]
    assert len(losses) == 5 and losses[-1] < losses[0] / 10, proc.stdout  # printed once per epoch, by rank 0 only
    assert "exported: ['model.safetensors']" in proc.stdout, proc.stdout
    assert (tmp_path / "quickstart_export" / "model.safetensors").is_file()


CHOOSING = REPO_ROOT / "docs" / "choosing.md"


def _table_rows(text: str, header: str) -> list[list[str]]:
    """The rows of the Markdown table whose header row starts with ``header`` (backticks dropped)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
    return rows


def test_the_strategy_page_maps_lightnings_names_to_the_same_presets() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightspeed.core.zero.config import ZERO_PRESETS

    rows = _table_rows(CHOOSING.read_text(), "Lightning")
    lightning_names = {n for n in StrategyRegistry.available_strategies() if n.startswith("deepspeed_stage")}
    assert {theirs for theirs, _ in rows} == lightning_names  # every one of Lightning's names, once
    for theirs, ours in rows:
        params = StrategyRegistry[theirs]["init_params"]
        nvme = params.get("remote_device") == "nvme"
        preset = ZERO_PRESETS[ours]
        assert preset.stage == params["stage"], theirs
        assert preset.offload_optimizer == ("nvme" if nvme else "cpu" if params.get("offload_optimizer") else "none")
        assert preset.offload_parameters == ("nvme" if nvme else "cpu" if params.get("offload_parameters") else "none")


def test_the_arguments_the_strategy_page_says_keep_their_names_do() -> None:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    text = " ".join(CHOOSING.read_text().split())
    listed = text.split("(`ZeroFabricStrategy` under Fabric):", 1)[1].split("keep their names", 1)[0]
    names = re.findall(r"`(\w+)`", listed)
    assert len(names) >= 10, listed
    for name in names:
        for cls in (DeepSpeedStrategy, lightspeed.strategies.ZeroStrategy, lightspeed.fabric.ZeroFabricStrategy):
            assert name in (_keywords_taken(cls) or ()), (name, cls.__name__)


def test_the_strategy_pages_memory_table_is_what_the_planner_prints(capsys: pytest.CaptureFixture[str]) -> None:
    text = CHOOSING.read_text()
    command = next(c.values[0] for c in _command_lines() if "--params 7e9" in c.values[0])
    args = build_parser().parse_args(shlex.split(command)[1:])
    args._run(args)
    printed = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [cell.split() for cell in line.split("|")]
        if len(cells) == 5 and cells[0] and cells[0][0].startswith("zero"):
            device, host, nvme = cells[1][-1], cells[2][-1], cells[3][0]
            printed[cells[0][0]] = [device, host, nvme]
    documented = {row[0]: row[1:] for row in _table_rows(text, "option")}
    assert documented == {name: printed[name] for name in documented}, printed
    assert set(printed) - set(documented) == {"zero3_offload_params"}  # named in the text: no strategy name of its own


def _source_text() -> str:
    """Every module of the package, with implicitly concatenated string literals joined (``"a " "b"`` -> ``"a b"``)."""
    text = "\n".join(path.read_text() for path in sorted((REPO_ROOT / "src" / "lightspeed").rglob("*.py")))
    return re.sub(r"\"\s*\n\s*(?:[rf]{0,2})\"", "", text)


def test_every_message_the_troubleshooting_page_quotes_is_printed_by_lightspeed() -> None:
    page = " ".join((REPO_ROOT / "docs" / "troubleshooting.md").read_text().split())
    source = " ".join(_source_text().split())
    quotes = re.findall(r'\*\*(?:`(\w+)`: )?"([^"]+)"', page)
    assert len(quotes) >= 8
    for error, quote in quotes:
        if error:
            assert hasattr(lightspeed.errors, error), error
        for fragment in (part.strip() for part in quote.split("…")):
            if len(fragment) > 3:
                assert fragment in source, (quote, fragment)
