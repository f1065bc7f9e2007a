"""DeepSpeed's ops come from the environment's prebuilt cache (scripts/setup.sh), built and loaded by one ninja."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightspeed.cli.env_command import _jit_cached, extension_cache
from lightspeed.core.zero.runtime import (
    TORCH_EXTENSIONS_ENV,
    torch_extensions_root,
    use_prebuilt_deepspeed_ops,
    venv_torch_extensions_dir,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
VENV = REPO_ROOT / ".venv"


def _fake_venv(tmp_path: Path, *, cache: bool = True, ninja: bool = True) -> Path:
    prefix = tmp_path / "venv"
    (prefix / "bin").mkdir(parents=True)
    if cache:
        (prefix / "torch_extensions").mkdir()
    if ninja:
        tool = prefix / "bin" / "ninja"
        tool.write_text("#!/bin/sh\necho 1.13.2\n")
        tool.chmod(0o755)
    return prefix


def _other_ninja(tmp_path: Path) -> Path:
    other = tmp_path / "system-bin"
    other.mkdir()
    tool = other / "ninja"
    tool.write_text("#!/bin/sh\necho 1.11.1\n")
    tool.chmod(0o755)
    return other


def test_unset_variable_points_at_the_venv_cache_from_sys_prefix(tmp_path, monkeypatch):
    prefix = _fake_venv(tmp_path, ninja=False)
    monkeypatch.setattr(sys, "prefix", str(prefix))
    monkeypatch.delenv(TORCH_EXTENSIONS_ENV, raising=False)
    assert venv_torch_extensions_dir() == prefix / "torch_extensions"
    assert use_prebuilt_deepspeed_ops() == prefix / "torch_extensions"
    assert os.environ[TORCH_EXTENSIONS_ENV] == str(prefix / "torch_extensions")
    assert torch_extensions_root() == prefix / "torch_extensions"


def test_no_prebuilt_cache_leaves_torch_default(tmp_path, monkeypatch):
    prefix = _fake_venv(tmp_path, cache=False)
    monkeypatch.delenv(TORCH_EXTENSIONS_ENV, raising=False)
    path_before = os.environ.get("PATH", "")
    assert use_prebuilt_deepspeed_ops(prefix) is None
    assert TORCH_EXTENSIONS_ENV not in os.environ
    assert os.environ.get("PATH", "") == path_before
    from torch.utils.cpp_extension import get_default_build_root

    assert torch_extensions_root() == Path(get_default_build_root())


def test_a_users_directory_is_never_replaced_and_path_is_left_alone(tmp_path, monkeypatch):
    prefix = _fake_venv(tmp_path)
    mine = tmp_path / "my_extensions"
    monkeypatch.setenv(TORCH_EXTENSIONS_ENV, str(mine))
    monkeypatch.setenv("PATH", str(_other_ninja(tmp_path)))
    assert use_prebuilt_deepspeed_ops(prefix) == mine
    assert os.environ[TORCH_EXTENSIONS_ENV] == str(mine)
    assert os.environ["PATH"] == str(tmp_path / "system-bin")


def test_the_venv_cache_is_built_by_the_venvs_ninja(tmp_path, monkeypatch):
    """torch runs `ninja` from PATH; a system ninja of another version rebuilds every op the venv's ninja built."""
    prefix = _fake_venv(tmp_path)
    system = _other_ninja(tmp_path)
    monkeypatch.delenv(TORCH_EXTENSIONS_ENV, raising=False)
    monkeypatch.setenv("PATH", f"{system}{os.pathsep}/usr/bin")
    use_prebuilt_deepspeed_ops(prefix)
    assert os.environ["PATH"] == os.pathsep.join([str(prefix / "bin"), str(system), "/usr/bin"])
    use_prebuilt_deepspeed_ops(prefix)  # idempotent: the venv's ninja is already the one PATH finds
    assert os.environ["PATH"] == os.pathsep.join([str(prefix / "bin"), str(system), "/usr/bin"])


def test_variable_already_naming_the_venv_cache_still_gets_the_venvs_ninja(tmp_path, monkeypatch):
    prefix = _fake_venv(tmp_path)
    system = _other_ninja(tmp_path)
    monkeypatch.setenv(TORCH_EXTENSIONS_ENV, str(prefix / "torch_extensions"))  # what scripts/env.sh sets
    monkeypatch.setenv("PATH", str(system))
    assert use_prebuilt_deepspeed_ops(prefix) == prefix / "torch_extensions"
    assert os.environ["PATH"] == os.pathsep.join([str(prefix / "bin"), str(system)])


def test_without_a_venv_ninja_path_is_unchanged(tmp_path, monkeypatch):
    prefix = _fake_venv(tmp_path, ninja=False)
    monkeypatch.delenv(TORCH_EXTENSIONS_ENV, raising=False)
    monkeypatch.setenv("PATH", str(_other_ninja(tmp_path)))
    use_prebuilt_deepspeed_ops(prefix)
    assert os.environ["PATH"] == str(tmp_path / "system-bin")


@pytest.mark.skipif(not (VENV / "torch_extensions").is_dir(), reason="scripts/setup.sh has not prebuilt the ops")
def test_import_lightspeed_without_env_sh_uses_the_prebuilt_ops_and_the_venvs_ninja():
    env = {k: v for k, v in os.environ.items() if k not in (TORCH_EXTENSIONS_ENV, "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if Path(p) != VENV / "bin")
    env["PYTHONPATH"] = str(REPO_ROOT / "src")
    code = "import lightspeed, os, shutil; print(os.environ['TORCH_EXTENSIONS_DIR']); print(shutil.which('ninja'))"
    proc = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr
    cache, ninja = proc.stdout.strip().splitlines()[-2:]
    assert cache == str(VENV / "torch_extensions")
    if (VENV / "bin" / "ninja").exists():
        assert ninja == str(VENV / "bin" / "ninja")


def test_env_reports_the_cache_and_finds_ops_in_it(tmp_path, monkeypatch):
    cache = tmp_path / "exts"
    (cache / "cpu_adam").mkdir(parents=True)
    (cache / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    monkeypatch.setenv(TORCH_EXTENSIONS_ENV, str(cache))
    assert extension_cache() == {"path": str(cache), "source": "TORCH_EXTENSIONS_DIR"}
    assert _jit_cached("cpu_adam") and not _jit_cached("async_io")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setenv(TORCH_EXTENSIONS_ENV, str(tmp_path / "torch_extensions"))
    assert extension_cache()["source"] == "this environment's prebuilt ops, from scripts/setup.sh"
    monkeypatch.delenv(TORCH_EXTENSIONS_ENV)
    default_root = tmp_path / "default"
    (default_root / "py311_cpu" / "cpu_adam").mkdir(parents=True)
    (default_root / "py311_cpu" / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    monkeypatch.setattr("lightspeed.cli.env_command.torch_extensions_root", lambda: default_root)
    assert extension_cache() == {
        "path": str(default_root),
        "source": "torch's default (TORCH_EXTENSIONS_DIR unset); one subfolder per Python/device build",
    }
    assert _jit_cached("cpu_adam")
