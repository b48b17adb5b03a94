"""A progress bar: tqdm when it is installed (the ``[progress]`` extra), plain lines otherwise."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    """Counts steps of one run on ``stream`` (stderr by default); silent when not ``enabled``.

    Draws a ``tqdm`` bar when ``bar`` and tqdm is importable; otherwise prints a line at every
    25% (no extra needed; right for logs).
    """

    def __init__(
        self,
        total: int,
        desc: str,
        enabled: bool = True,
        stream: TextIO | None = None,
        bar: bool = True,
    ) -> None:
        self.total, self.desc, self.enabled = total, desc, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.count = 0
        self._bar: Any = None
        self._next_mark = 0.25
        if not enabled:
            return
        try:
            if not bar:
                raise ImportError("no bar asked for")
            from tqdm import tqdm
        except ImportError:
            print(f"{desc}: training {total} steps", file=self.stream, flush=True)
        else:
            self._bar = tqdm(total=total, desc=desc, file=self.stream, leave=True, ncols=80)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.close()

    def update(self) -> None:
        """Advance by one step.

        Host sync: none.
        """
        self.count += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
        elif self.count >= self._next_mark * self.total:
            while self._next_mark * self.total <= self.count:
                self._next_mark += 0.25
            pct = 100 * self.count // self.total
            print(f"{self.desc}: {self.count}/{self.total} ({pct}%)", file=self.stream, flush=True)
