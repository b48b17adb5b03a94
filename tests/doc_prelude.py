"""Run at the start of each documentation snippet by tests/docs/test_doc_snippets.py (with runpy,
on the
snippet file's first line, which is blank padding in the doc: the snippet keeps its doc line
numbers and gets no name of ours in its namespace).

It runs the snippet in its own folder (the files it writes land there, not in the repository),
and does two things a user's fresh interpreter would not notice:

- seeds torch's generator and Python's ``random`` with ``SNIPPET_SEED``. A fresh interpreter
  starts torch from a random seed (torch 2.13) and forked children would all share their
  parent's; a fixed seed makes every run of the test the same, and since it is not the state
  the doc's author ran from, a value shown in the doc that depends on an unseeded draw fails
  here (unless it happens to hold for this seed too);
- records what the snippet writes to stdout: ``SNIPPET.stdout`` (everything), and
  ``SNIPPET.prints.jsonl`` (each ``print`` call: the snippet lines on its call stack and its
  text) for the ``# prints ...`` comments.

``SNIPPET`` is given in the globals runpy runs this file with.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import random
import sys
from typing import Any

import torch

SNIPPET_SEED = 20260429


class _Tee(io.TextIOBase):
    """sys.stdout, also written to a file."""

    def __init__(self, real: Any, copy: Any) -> None:
        self._real, self._copy = real, copy

    def write(self, text: str) -> int:
        self._copy.write(text)
        self._copy.flush()
        return self._real.write(text)

    def flush(self) -> None:
        self._real.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _snippet_lines(path: str) -> list[int]:
    """The snippet's lines on the call stack of a print: the print's own line and the calls
    that led to it (``scaler.update()`` running a hook that prints)."""
    lines = []
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == path:
            lines.append(frame.f_lineno)
        frame = frame.f_back
    return lines


def start(path: str) -> None:
    os.chdir(os.path.dirname(os.path.abspath(path)))
    torch.manual_seed(SNIPPET_SEED)
    random.seed(SNIPPET_SEED)
    sys.stdout = _Tee(sys.stdout, open(path + ".stdout", "w", encoding="utf-8"))  # noqa: SIM115
    prints = open(path + ".prints.jsonl", "w", encoding="utf-8")  # noqa: SIM115
    original = builtins.print

    def recording_print(*args: Any, **kwargs: Any) -> None:
        target = kwargs.get("file")
        if target is not None and target is not sys.stdout:
            original(*args, **kwargs)
            return
        text = io.StringIO()
        original(*args, **{**kwargs, "file": text})
        prints.write(json.dumps({"lines": _snippet_lines(path), "text": text.getvalue()}) + "\n")
        prints.flush()
        sys.stdout.write(text.getvalue())
        if kwargs.get("flush"):
            sys.stdout.flush()

    builtins.print = recording_print


start(globals()["SNIPPET"])
