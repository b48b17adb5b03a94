"""The ``mixprec`` command line: ``mixprec demo``, ``mixprec advise`` (or ``python -m mixprec``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mixprec.errors import MixprecError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from mixprec.cli import advise, demo

    parser = argparse.ArgumentParser(
        prog="mixprec", description="mixprec: automatic mixed precision for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo.add_parser(sub)
    advise.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 on success).

    Bad options print a usage line and a message on stderr and return 2; an error that mixprec
    raises while running prints its message and returns 1 (no traceback either way).

    Example:
        >>> from mixprec.cli import main
        >>> main(["demo", "--steps", "0"])  # bad option: message on stderr
        2
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on bad options
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_usage(sys.stderr)
        print("mixprec: error: choose a command, e.g. `mixprec demo`", file=sys.stderr)
        return 2
    problem = args.check(args)
    if problem is not None:
        parser.print_usage(sys.stderr)
        print(f"mixprec {args.command}: error: {problem}", file=sys.stderr)
        return 2
    try:
        return int(args.handler(args))
    except MixprecError as exc:
        print(f"mixprec {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"mixprec {args.command}: interrupted", file=sys.stderr)
        return 130
