"""The numbers in the docs come from runs: docs/quickstart.md's demo table is the table that
`mixprec demo` prints with its defaults, every column but the timings ("wall s").

The demo is deterministic for a given CPU kind (one thread, seeded). When it changes, regenerate
the table with `make docs-numbers` (``python -m tests.test_docs_numbers --write``).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

from mixprec.cli import main

PAGE = Path(__file__).resolve().parent.parent / "docs" / "quickstart.md"
BLOCK = re.compile(r"(<!-- demo-table[^\n]*-->\n```text\n)(.*?)(```\n<!-- /demo-table -->)", re.S)


def demo_table() -> str:
    """The table of a default `mixprec demo` run (no figure, no progress)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["demo", "--no-plot", "--no-progress"])
    assert status == 0
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run "))
    end = lines.index("", start)
    return "\n".join(lines[start:end]) + "\n"


def _without_timings(table: str) -> list[list[str]]:
    return [line.split()[:-1] if line.strip() else [] for line in table.splitlines()]


def _page_table() -> str:
    match = BLOCK.search(PAGE.read_text(encoding="utf-8"))
    assert match, f"{PAGE.name} has no <!-- demo-table --> block"
    return match.group(2)


def test_quickstart_demo_table_is_what_the_demo_prints() -> None:
    fresh = demo_table()
    assert _without_timings(_page_table()) == _without_timings(fresh), (
        f"docs/quickstart.md's demo table is stale; run `make docs-numbers`. The demo now "
        f"prints:\n{fresh}"
    )


def write() -> None:
    text = PAGE.read_text(encoding="utf-8")
    fresh = demo_table()
    PAGE.write_text(BLOCK.sub(lambda m: m.group(1) + fresh + m.group(3), text), encoding="utf-8")
    print(fresh, end="")


if __name__ == "__main__" and "--write" in sys.argv:
    write()
