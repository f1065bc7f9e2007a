"""The ``lightspeed`` console script: one command with subcommands ``env``, ``test``, ``estimate``, ``config``,
``export`` and ``tune``.

Each subcommand is a module that declares itself once as ``COMMAND``, a :class:`~lightspeed.cli.usage.Command`
(name, ``--help`` texts, ``add_arguments(parser)`` and ``run(args) -> int``); :data:`SUBCOMMANDS` lists them.
Exit codes: 0 success, 1 a check failed (``lightspeed test``), 2 a user error (one message on stderr, no traceback),
130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightspeed._version import __version__
from lightspeed.cli import config_command, env_command, estimate_command, export_command, tune_command
from lightspeed.cli.selftest import command as test_command
from lightspeed.cli.usage import EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR, Command, UsageError

#: subcommand name -> its declaration, in the order ``lightspeed --help`` lists them
SUBCOMMANDS: dict[str, Command] = {
    command.name: command
    for command in (
        env_command.COMMAND,
        test_command.COMMAND,
        estimate_command.COMMAND,
        config_command.COMMAND,
        export_command.COMMAND,
        tune_command.COMMAND,
    )
}


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that report user mistakes with a message meant to be read, not a traceback: every lightspeed
    error (:class:`~lightspeed.errors.LightspeedError`) and the CLI's own :class:`UsageError`."""
    from lightspeed.core.errors import LightspeedError

    return (UsageError, LightspeedError)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="lightspeed",
        description="DeepSpeed ZeRO for PyTorch Lightning: check this machine, plan memory, print configs, export.",
    )
    parser.add_argument("--version", action="version", version=f"lightspeed {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in SUBCOMMANDS.values():
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand and return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return EXIT_USER_ERROR
    try:
        return int(run(args) or EXIT_OK)
    except _user_error_types() as error:
        print(f"lightspeed {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"lightspeed {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
