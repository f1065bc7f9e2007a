"""What the ``lightspeed`` subcommands share: how each declares itself (:class:`Command`), the exit codes, the
error for a bad request, the check that a strategy offloading to NVMe was given its directory, and the options
spelled the same in every command (``--accelerator``, ``--device-memory`` / ``--host-memory``, old spellings kept as
hidden deprecated aliases)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from lightspeed.core.zero.config import NVME_PATH_ENV

_Options = TypeVar("_Options")

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


def options_from(options_class: type[_Options], args: argparse.Namespace, **given: Any) -> _Options:
    """An options dataclass built from the parsed command line: every constructor field that the command declares an
    option of the same name for, then ``given`` (values the command derives itself), so each command lists only what
    it spells differently."""
    taken = {f.name: getattr(args, f.name) for f in fields(options_class) if f.init and hasattr(args, f.name)}  # type: ignore[arg-type]
    return options_class(**{**taken, **given})


def require_nvme_path(strategy: str, nvme_path: str | None) -> None:
    """:class:`UsageError` unless ``--nvme-path`` or ``$LIGHTSPEED_NVME_PATH`` names the NVMe directory."""
    if not (nvme_path or os.environ.get(NVME_PATH_ENV)):
        raise UsageError(
            f"{strategy} offloads to NVMe: pass --nvme-path DIR (a directory on an NVMe drive) or set {NVME_PATH_ENV}."
        )


#: the accelerators of the commands that run the Trainer, in Lightning's spelling (``"gpu"``, Lightning's own alias
#: of ``"cuda"``, is taken too and means ``"cuda"``)
ACCELERATORS = ("auto", "cpu", "cuda")


def _accelerator(value: str) -> str:
    value = value.strip().lower()
    return "cuda" if value == "gpu" else value


def add_accelerator_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--accelerator {auto,cpu,cuda}`` (default ``auto``), the same in every command; ``gpu`` is read as
    ``cuda``, as Lightning reads it."""
    parser.add_argument("--accelerator", type=_accelerator, choices=ACCELERATORS, default="auto", help=help_text)


#: the precisions ``--precision`` takes, as Lightning spells them (the Trainer's default, 32-true, first)
PRECISIONS_TEXT = "32-true, bf16-mixed, 16-mixed, bf16-true or 16-true"

#: the help of ``--device-memory`` / ``--host-memory``: the budgets of the memory planner, as ``zero_auto``'s
#: ``device_memory=`` / ``host_memory=``
DEVICE_MEMORY_HELP = "memory per device, with a unit (80GB, 24GiB), instead of the free memory of the GPUs here"
HOST_MEMORY_HELP = "host memory per node, with a unit (256GB, 64GiB), instead of the memory available here"


class _DeprecatedAlias(argparse.Action):
    """An old spelling of another option: does what that option does, after a warning on stderr that names it.
    Hidden from ``--help``."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, replacement: argparse.Action) -> None:
        # the replacement's way of reading its value (argparse converts and checks it with these); its default stays
        settings: dict[str, Any] = {
            "nargs": replacement.nargs,
            "const": replacement.const,
            "type": replacement.type,
            "choices": replacement.choices,
            "metavar": replacement.metavar,
        }
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **settings)
        self.replacement = replacement

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        new = self.replacement.option_strings[-1]
        print(f"{parser.prog}: warning: {option_string} is deprecated and will be removed; use {new}", file=sys.stderr)
        self.replacement(parser, namespace, values, new)


def add_deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Keep ``old`` working as a hidden, deprecated spelling of the option ``new`` (already added to ``parser``):
    the same value in the same place, and a warning on stderr naming ``new``."""
    replacement = next(action for action in parser._actions if new in action.option_strings)
    parser.add_argument(old, action=_DeprecatedAlias, dest=replacement.dest, replacement=replacement)
