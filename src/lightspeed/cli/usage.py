"""What the ``lightspeed`` subcommands share: how each declares itself (:class:`Command`), the exit codes, the
error for a bad request, and the check that a strategy offloading to NVMe was given its directory."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass

from lightspeed.core.zero.config import NVME_PATH_ENV

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USER_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclass(frozen=True, kw_only=True)
class Command:
    """A subcommand, declared once in its module as ``COMMAND``: its name, its ``--help`` texts, the function that
    adds its arguments and the one that runs it (returning the exit code). :mod:`lightspeed.cli.main` adds every
    command's sub-parser with :meth:`add_parser`."""

    name: str
    help: str
    description: str
    epilog: str | None = None
    #: keep the line breaks of ``description`` and ``epilog`` as written (else argparse re-wraps them)
    preformatted: bool = False
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    def add_parser(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        """Add this command's sub-parser to ``subparsers``; the parsed arguments carry :attr:`run` as ``_run``."""
        parser = subparsers.add_parser(
            self.name,
            help=self.help,
            description=self.description,
            epilog=self.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter if self.preformatted else argparse.HelpFormatter,
        )
        self.add_arguments(parser)
        parser.set_defaults(_run=self.run)
        return parser


class UsageError(Exception):
    """A problem with what the user asked for; the command prints the message and exits with code 2."""


def require_nvme_path(strategy: str, nvme_path: str | None) -> None:
    """:class:`UsageError` unless ``--nvme-path`` or ``$LIGHTSPEED_NVME_PATH`` names the NVMe directory."""
    if not (nvme_path or os.environ.get(NVME_PATH_ENV)):
        raise UsageError(
            f"{strategy} offloads to NVMe: pass --nvme-path DIR (a directory on an NVMe drive) or set {NVME_PATH_ENV}."
        )
