"""lightspeed installs like a library: a wheel built from the sources (not the editable install the suite runs on)
installs into a fresh directory and works from there, ``lightspeed env`` included; the requirements the README states
are those of ``pyproject.toml``."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import tomllib

from _support.launch import REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def test_a_built_wheel_installs_and_runs_without_the_sources(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: the build writes build/ and egg-info next to the sources
    shutil.copytree(REPO_ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist"]
    subprocess.run([*build, source], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("lightspeed-*.whl")
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", tmp_path / "site", wheel]
    subprocess.run(install, check=True, capture_output=True, text=True, timeout=300)
    assert (tmp_path / "site" / "bin" / "lightspeed").is_file()  # the console script
    assert (tmp_path / "site" / "lightspeed" / "py.typed").is_file()  # PEP 561: type checkers read lightspeed's types

    # -S: no .pth files, so the editable install's path to src/ is not there; the other packages come from this venv
    env = {"PYTHONPATH": f"{tmp_path / 'site'}:{sysconfig.get_paths()['purelib']}", "PATH": "/usr/bin:/bin"}
    check = "import lightspeed; print(lightspeed.__file__, lightspeed.__version__)"
    found = subprocess.run([sys.executable, "-S", "-c", check], env=env, cwd=tmp_path, capture_output=True, text=True)
    location, version = found.stdout.split()
    assert Path(location).is_relative_to(tmp_path / "site"), found.stdout
    assert version == PYPROJECT["project"]["version"]
    cli = [sys.executable, "-S", "-m", "lightspeed.cli.main", "env"]
    report = subprocess.run(cli, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    assert re.search(r"^\s+zero3_offload\s+ok$", report.stdout, re.MULTILINE), report.stdout


def test_the_readme_states_the_requirements_of_pyproject() -> None:
    readme = " ".join((REPO_ROOT / "README.md").read_text().split())
    python = PYPROJECT["project"]["requires-python"]
    assert f"Python {python}" in readme
    for requirement in PYPROJECT["project"]["dependencies"]:
        name, specifier = re.match(r"([A-Za-z0-9_.-]+)(.*)", requirement).groups()  # type: ignore[union-attr]
        if name in ("torch", "lightning", "deepspeed", "torchmetrics", "safetensors"):
            assert f"{name} {specifier.replace(' ', '')}" in readme, requirement
