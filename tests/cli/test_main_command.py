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


def _option(command: str, flag: str):
    parser = build_parser()._subparsers._group_actions[0].choices[command]
    return next(action for action in parser._actions if flag in action.option_strings)


@pytest.mark.parametrize("command", ["test", "tune"])
def test_the_commands_that_train_spell_the_accelerator_as_lightning(capsys, command):
    """``--accelerator`` takes the same choices wherever it appears, Lightning's spelling (``cuda``); ``gpu``,
    Lightning's own alias, is read as ``cuda`` without a warning (``lightspeed test`` took ``gpu`` before)."""
    factory = ["my_pkg.train:job"] if command == "tune" else []
    parse = build_parser().parse_args
    assert _option(command, "--accelerator").choices == ("auto", "cpu", "cuda")
    assert parse([command, *factory]).accelerator == "auto"
    for given, read in [("cpu", "cpu"), ("cuda", "cuda"), ("gpu", "cuda"), ("GPU", "cuda"), ("auto", "auto")]:
        assert parse([command, *factory, "--accelerator", given]).accelerator == read
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        parse([command, *factory, "--accelerator", "tpu"])
    assert "invalid choice: 'tpu' (choose from 'auto', 'cpu', 'cuda')" in capsys.readouterr().err


def test_the_memory_budgets_are_spelled_as_zero_auto_spells_them():
    """``--device-memory`` / ``--host-memory`` in ``estimate`` and ``tune``, as ``ZeroAutoStrategy(device_memory=...,
    host_memory=...)``; the same help in both."""
    for flag in ("--device-memory", "--host-memory"):
        estimate, tune = _option("estimate", flag), _option("tune", flag)
        assert (estimate.dest, estimate.metavar, estimate.help) == (tune.dest, tune.metavar, tune.help)


@pytest.mark.parametrize("command", ["estimate", "tune"])
def test_the_default_precision_is_the_trainers(command):
    """``32-true``, Lightning's default; ``lightspeed config`` leaves the precision keys "auto" without
    ``--precision`` and ``lightspeed test`` picks the GPU's mixed precision on GPUs (their help says why)."""
    assert _option(command, "--precision").default == "32-true"
    assert _option("config", "--precision").default is None
    assert _option("test", "--precision").default is None
