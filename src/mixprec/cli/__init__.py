"""The ``mixprec`` command line: ``demo``, ``advise``, ``dry-run`` (or ``python -m mixprec``).

Each subcommand is a module of this package that defines ``COMMAND``, a
:class:`mixprec.cli._command.Command`; :data:`COMMANDS` lists them. The conventions every
subcommand gets (help, usage on errors, one-line errors, stdout that cannot be written, progress)
are described in :mod:`mixprec.cli._command`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import re
import sys
from collections.abc import Sequence

from mixprec.cli._command import Command, CommandError, HelpFormatter
from mixprec.cli._output import OutputClosed, silence
from mixprec.errors import MixprecError

__all__ = ["COMMANDS", "main"]

#: The subcommands, in the order ``mixprec --help`` lists them (modules of ``mixprec.cli``).
COMMANDS = ("demo", "advise", "dry_run")

_EXAMPLES = """examples:
  mixprec demo                  why fp16 training needs loss scaling, measured and drawn
  mixprec demo --help           the demo's options
  mixprec advise --help         propose a precision policy for your model
  mixprec dry-run --help        what a policy would run on a GPU, checked on the CPU
  python -m mixprec --version
"""


def _version() -> str:
    import torch

    import mixprec

    return f"mixprec {mixprec.__version__} (torch {torch.__version__})"


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="mixprec",
        description="mixprec: automatic mixed precision for PyTorch.",
        epilog=_EXAMPLES,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND")
    parsers = {}
    for name in COMMANDS:
        command: Command = importlib.import_module(f"mixprec.cli.{name}").COMMAND
        parsers[command.name] = command.build(sub)
    return parser, parsers


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    0: success; 1: the command failed (one line on stderr, no traceback); 2: bad options (the
    command's usage and a message on stderr); 130: interrupted (Ctrl-C).

    Example:
        >>> from mixprec.cli import main
        >>> main(["demo", "--steps", "0"])  # bad option: usage and message on stderr
        2

    Host sync: whatever the command does.
    """
    parser, parsers = _parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if args.command_name is None:
            parser.error("choose a command, e.g. `mixprec demo` (`mixprec --help` lists them)")
        command: Command = args.command
        if extra:
            parsers[command.name].error(_unrecognized(extra, parsers[command.name]))
        problem = command.check(args)
        if problem is not None:
            parsers[command.name].error(problem)
    except SystemExit as exc:  # argparse exits on --help, --version and bad options
        return exc.code if isinstance(exc.code, int) else 2
    return _run(command, args)


def _unrecognized(extra: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's message for arguments it did not recognize, with the closest option of the
    command for each mistyped flag (``--modles``: did you mean ``--modules``?)."""
    known = sorted(set(re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", parser.format_help())))
    hints = []
    for arg in extra:
        flag = arg.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, 1, 0.6) if flag.startswith("-") else []
        if close:
            hints.append(f"{flag}: did you mean {close[0]}?")
    tail = f" ({'; '.join(hints)})" if hints else ""
    return f"unrecognized arguments: {' '.join(extra)}{tail}"


def _run(command: Command, args: argparse.Namespace) -> int:
    prog = f"mixprec {command.name}"
    try:
        status = int(command.run(args))
        _flush_stdout()
        return status
    except (CommandError, MixprecError) as exc:
        _error(f"{prog}: error: {exc}")
        return 1
    except OutputClosed as exc:
        silence(sys.stdout)
        _error(f"{prog}: error: cannot write the results to standard output ({exc.reason})")
        return 1
    except BrokenPipeError:  # a write to stdout that did not go through emit()
        silence(sys.stdout)
        _error(f"{prog}: error: cannot write the results to standard output (Broken pipe)")
        return 1
    except KeyboardInterrupt:
        _error(f"{prog}: interrupted")
        return 130


def _flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except OSError as exc:
        raise OutputClosed(exc.strerror or str(exc)) from None


def _error(line: str) -> None:
    with contextlib.suppress(OSError):  # stderr is gone too: nothing left to tell
        print(line, file=sys.stderr, flush=True)
