"""A dry run as text: one line per (module, matmul), the detail wrapped, then the memory."""

from __future__ import annotations

import textwrap
from typing import Any


def human(n: int | None) -> str:
    """Bytes as ``12.0 KiB``/``3.5 MiB``; ``-`` for None. Host sync: none."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _grid(head: list[str], body: list[list[str]], width: int) -> list[str]:
    """Columns sized to their contents; the last one wrapped to fit ``width``."""
    cols = len(head)
    sizes = [max(len(r[i]) for r in [head, *body]) for i in range(cols - 1)]
    room = max(20, width - sum(sizes) - 2 * (cols - 1))
    lines = []
    for r in [head, *body]:
        lead = "  ".join(c.ljust(s) for c, s in zip(r, sizes, strict=False))
        wrapped = textwrap.wrap(r[-1], room) or [""]
        lines.append(f"{lead}  {wrapped[0]}".rstrip())
        pad = " " * (len(lead) + 2)
        lines.extend(f"{pad}{w}" for w in wrapped[1:])
    return lines


def render(run: Any, width: int = 100) -> str:
    """The text of a :class:`~mixprec._src.dryrun.run.DryRun`. Host sync: none."""
    seen: dict[tuple[str, ...], int] = {}
    first = {m: i for i, m in reversed(list(enumerate(r.module for r in run.rows)))}
    order = ("fprop", "dgrad", "wgrad")
    rows = sorted(run.rows, key=lambda r: (first[r.module], order.index(r.matmul)))
    for r in rows:
        key = (r.module, r.matmul, r.recipe, r.verdict, r.detail)
        seen[key] = seen.get(key, 0) + 1
    body = [[*k[:4], k[4] + (f" (x{n})" if n > 1 else "")] for k, n in seen.items()]
    cc = ".".join(map(str, run.capability))
    lines = [f"dry run on {run.gpu} (compute capability {cc}): {len(run.rows)} matmuls"]
    lines += _grid(["module", "matmul", "recipe", "verdict", "kernel / why"], body, width)
    if run.error is not None:
        lines += textwrap.wrap("stopped: " + run.error, width)
    mem = [
        [s.module, s.rule, human(s.mixprec), human(s.bf16), human(s.torchao)]
        for s in run.saved
        if s.mkn is not None
    ]
    if mem:
        lines += ["", "saved for backward (parameters not counted)"]
        lines += _grid(["module", "rule", "mixprec", "bf16 autocast", "torchao"], mem, width)
    return "\n".join(lines)
