"""The ``lightspeed`` console script: one command with subcommands ``env``, ``test``, ``estimate``, ``config``,
``export`` and ``tune``.

Each subcommand is a module (:data:`SUBCOMMANDS`) that defines ``add_parser(subparsers)`` and ``run(args) -> int``.
Exit codes: 0 success, 1 a check failed (``lightspeed test``), 2 a user error (one message on stderr, no traceback),
130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from lightspeed._version import __version__
from lightspeed.cli.usage import EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR, UsageError

#: subcommand -> the module that implements it
SUBCOMMANDS = {
    "env": "lightspeed.cli.env_command",
    "test": "lightspeed.cli.selftest.command",
    "estimate": "lightspeed.cli.estimate_command",
    "config": "lightspeed.cli.config_command",
    "export": "lightspeed.cli.export_command",
    "tune": "lightspeed.cli.tune_command",
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
    for module_name in SUBCOMMANDS.values():
        module = importlib.import_module(module_name)
        before = set(subparsers.choices)
        module.add_parser(subparsers)
        for added in set(subparsers.choices) - before:
            subparsers.choices[added].set_defaults(_run=module.run)
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
