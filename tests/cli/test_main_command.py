"""The ``lightspeed`` console script: subcommands, --help on each, exit codes."""

from __future__ import annotations

import importlib.metadata

import pytest

from lightspeed.cli.main import SUBCOMMANDS, build_parser, main


def test_console_script_is_installed_and_lists_every_subcommand(capsys):
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["lightspeed"] == "lightspeed.cli.main:main"
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert f"\n    {name} " in out, f"{name} missing from --help"


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_help_on_each_subcommand(capsys, name):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: lightspeed {name}")


def test_no_subcommand_and_unknown_subcommand_are_usage_errors(capsys):
    assert main([]) == 2
    assert "usage: lightspeed" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_every_subcommand_is_wired():
    assert set(build_parser()._subparsers._group_actions[0].choices) == set(SUBCOMMANDS)
