"""What every ``mixprec`` subcommand gets from the main parser, so that a new one is consistent.

A subcommand module defines ``COMMAND = Command(...)``: its name, a one-line summary, a plain-text
description, a few example command lines, a function that adds its options, an optional
cross-option check and the function that runs it. :func:`mixprec.cli.main` then gives it:

* ``--help`` that shows every option's default and the examples, with no markup;
* errors in options or in the check print the subcommand's own usage and exit with status 2;
* errors while running (:class:`CommandError`, :class:`~mixprec.errors.MixprecError`) print one
  line, ``mixprec NAME: error: ...``, and exit with status 1; Ctrl-C prints one line and exits
  with status 130;
* standard output that cannot be written (a closed pipe, a full disk) is one line on stderr
  and status 1, never a traceback (write results with :func:`mixprec.cli._output.emit`);
* ``--no-progress`` when ``progress=True``, and :func:`progress` to draw a bar on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mixprec.cli._progress import Progress

__all__ = ["Command", "CommandError", "HelpFormatter", "progress"]


class CommandError(Exception):
    """A run-time failure to report as one line (``mixprec NAME: error: <message>``), status 1."""


def _no_check(args: argparse.Namespace) -> str | None:
    return None


@dataclass(frozen=True)
class Command:
    """One ``mixprec`` subcommand.

    Attributes:
        name: the word after ``mixprec``.
        summary: one line for ``mixprec --help``.
        description: plain text (no markup) for ``mixprec NAME --help``; paragraphs are kept.
        examples: command lines shown under "examples:" in ``--help``.
        add_arguments: adds the options to the subcommand's parser. Give every option a
            ``help``; the default is appended to it (``(default: ...)``), except for flags and
            options whose default is None.
        run: runs the command; returns the exit status. Raise :class:`CommandError` for a
            one-line failure (after printing whatever results there are).
        check: cross-option checks after parsing; returns an error message or None.
        progress: the command draws progress bars (adds ``--no-progress``).
    """

    name: str
    summary: str
    description: str
    examples: tuple[str, ...]
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    check: Callable[[argparse.Namespace], str | None] = _no_check
    progress: bool = False

    def build(self, sub: Any) -> argparse.ArgumentParser:
        """Add this command to ``sub`` (an argparse subparsers object) and return its parser.

        Host sync: none.
        """
        epilog = "examples:\n" + "\n".join(f"  {line}" for line in self.examples)
        parser: argparse.ArgumentParser = sub.add_parser(
            self.name,
            help=self.summary,
            description=self.description,
            epilog=epilog if self.examples else None,
            formatter_class=HelpFormatter,
        )
        self.add_arguments(parser)
        if self.progress:
            parser.add_argument(
                "--no-progress",
                action="store_true",
                help="print no progress on stderr",
            )
        parser.set_defaults(command=self)
        return parser


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's and the examples' line breaks; appends each option's default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = default is not None and default is not argparse.SUPPRESS
        shown = shown and not isinstance(default, bool) and action.option_strings != []
        if shown and "%(default)" not in text and "default:" not in text:
            text += " (default: %(default)s)"
        return text


def progress(args: argparse.Namespace, total: int, desc: str) -> Progress:
    """A progress counter for ``total`` steps, as the command line's options ask.

    A tqdm bar when stderr is a terminal and tqdm is installed, a line at every 25% otherwise;
    nothing with ``--no-progress``.

    Host sync: none.
    """
    enabled = not getattr(args, "no_progress", False)
    return Progress(total, desc, enabled=enabled, bar=sys.stderr.isatty())
