"""The dtype report: which aten ops ran, in which module, with which input and output dtypes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from mixprec._src.autocast.modules import current_module_name
from mixprec._src.autocast.rules import format_dtype
from mixprec._src.torch_compat import DispatchMode, op_name, pytree_leaves

_SKIP = frozenset({"aten::detach", "aten::alias", "aten::lift_fresh"})


class ReportRow(NamedTuple):
    """One line of a :class:`DtypeReport`: an op seen ``count`` times with these dtypes.

    Host sync: none.
    """

    module: str
    op: str
    input_dtypes: tuple[str, ...]
    output_dtype: str
    count: int  # type: ignore[assignment]  # the issue names this field "count"


def _dtypes(value: Any) -> tuple[str, ...]:
    return tuple(format_dtype(t.dtype) for t in pytree_leaves(value) if isinstance(t, torch.Tensor))


class _Recorder(DispatchMode):
    """Observes (never changes) every aten op below autograd; opt-in because it is slow."""

    def __init__(self, report: DtypeReport, phase: str) -> None:
        super().__init__()
        self.report = report
        self.phase = phase

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = op_name(func)
        if name in _SKIP or (getattr(func, "is_view", False) and not self.report.include_views):
            return out
        outs = _dtypes(out)
        module = current_module_name() if self.phase == "forward" else None
        self.report.add(self.phase, module, name, _dtypes((args, kwargs)), outs[0] if outs else "")
        return out


class DtypeReport:
    """A table of (module, op, input dtypes, output dtype, count) for a region.

    Filled by ``mixprec.autocast(report=True)`` for the forward; wrap the backward in
    ``report.backward()`` to add its rows. View ops are left out unless ``include_views``.

    Example:
        >>> import torch
        >>> import mixprec
        >>> lin = torch.nn.Linear(4, 4)
        >>> with mixprec.autocast("cpu", torch.bfloat16, report=True) as ac:
        ...     y = lin(torch.randn(2, 4))
        >>> ("", "aten::addmm", ("bf16", "bf16", "bf16"), "bf16", 1) in ac.report.rows
        True
        >>> with ac.report.backward():
        ...     y.float().sum().backward()
        >>> len(ac.report.backward_rows) > 0
        True

    Host sync: none (recording reads dtypes only).
    """

    def __init__(self, *, include_views: bool = False) -> None:
        self.include_views = include_views
        self._counts: dict[tuple[str, str, str, tuple[str, ...], str], int] = {}

    def add(
        self, phase: str, module: str | None, op: str, inputs: tuple[str, ...], output: str
    ) -> None:
        """Count one op call. Host sync: none."""
        key = (phase, "-" if module is None else module, op, inputs, output)
        self._counts[key] = self._counts.get(key, 0) + 1

    def _rows(self, phase: str) -> list[ReportRow]:
        return [ReportRow(*k[1:], count=c) for k, c in self._counts.items() if k[0] == phase]

    @property
    def rows(self) -> list[ReportRow]:
        """Forward rows, in first-seen order. Host sync: none."""
        return self._rows("forward")

    @property
    def backward_rows(self) -> list[ReportRow]:
        """Rows recorded under :meth:`backward` (module is ``"-"``). Host sync: none."""
        return self._rows("backward")

    @contextmanager
    def record(self, phase: str = "forward") -> Iterator[DtypeReport]:
        """Record every aten op run inside the block under ``phase``.

        Example:
            >>> import torch
            >>> rep = DtypeReport()
            >>> with rep.record():
            ...     _ = torch.ones(2) * 2
            >>> rep.rows[-1].op
            'aten::mul.Tensor'

        Host sync: none.
        """
        with _Recorder(self, phase):
            yield self

    def backward(self) -> Any:
        """Context manager recording a backward pass into :attr:`backward_rows`.

        Example:
            >>> import torch
            >>> rep = DtypeReport()
            >>> x = torch.ones(2, requires_grad=True)
            >>> with rep.backward():
            ...     (x * 2).sum().backward()
            >>> bool(rep.backward_rows)
            True

        Host sync: none.
        """
        return self.record("backward")

    def table(self, phase: str = "forward") -> str:
        """The rows of ``phase`` as an aligned text table. Host sync: none."""
        rows = self._rows(phase)
        head = ("module", "op", "inputs", "output", "count")
        cells = [head] + [
            (r.module or "(root)", r.op, ",".join(r.input_dtypes), r.output_dtype, str(r.count))
            for r in rows
        ]
        widths = [max(len(c[i]) for c in cells) for i in range(5)]
        lines = ["  ".join(c[i].ljust(widths[i]) for i in range(5)).rstrip() for c in cells]
        return "\n".join(lines)

    def __str__(self) -> str:
        text = self.table("forward")
        if self.backward_rows:
            text += "\n\nbackward\n" + self.table("backward")
        return text

    def __repr__(self) -> str:
        return (
            f"DtypeReport({len(self.rows)} forward rows, {len(self.backward_rows)} backward rows)"
        )
