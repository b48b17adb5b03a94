"""``Fp8Stats``: per-module, per-operand fp8 cast statistics, device tensors until read."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import TracebackType

import torch

from mixprec._src.devices import caps
from mixprec._src.fp8.casts import STAT_COLUMNS

OPERANDS = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class Fp8CastStats:
    """What the fp8 casts of one operand of one module did, since the stats were last reset.

    Attributes:
        amax: the largest magnitude seen (NaN or inf once a non-finite value arrived).
        scale: the smallest scale used (0 or NaN after a non-finite amax).
        saturated: fraction of cast elements at the format's largest magnitude.
        flushed: fraction of cast elements that were non-zero and became zero.
        nonfinite: number of inf/NaN elements seen in the high-precision operand.
        elements: number of elements cast (an operand cast for two matmuls counts twice).
    """

    amax: float
    scale: float
    saturated: float
    flushed: float
    nonfinite: int
    elements: int


@dataclass(frozen=True)
class Fp8ModuleStats:
    """The fp8 statistics of one module: its recipe and one :class:`Fp8CastStats` per operand.

    ``grad_output`` stays empty (``elements == 0``) until a backward pass ran.
    """

    recipe: str
    input: Fp8CastStats
    weight: Fp8CastStats
    grad_output: Fp8CastStats


class Slot:
    """The accumulating stats tensor of one module: rows :data:`OPERANDS`, columns
    ``STAT_COLUMNS`` (amax max-reduced, scale min-reduced, counts summed). Host sync: none."""

    __slots__ = ("data", "recipe")

    def __init__(self, device: torch.device, recipe: str) -> None:
        self.recipe = recipe
        self.data = torch.zeros(
            len(OPERANDS), len(STAT_COLUMNS), dtype=caps(device).wide_float, device=device
        )
        self.data[:, 1] = float("inf")

    def add(self, operand: int, row: torch.Tensor) -> None:
        """Merge one cast's stats row into operand ``operand``'s row. Host sync: none."""
        cur = self.data[operand]
        merged = torch.cat(
            [
                torch.maximum(cur[:1], row[:1]),
                torch.minimum(cur[1:2], row[1:2]),
                cur[2:] + row[2:],
            ]
        )
        cur.copy_(merged)


class _Active(threading.local):
    def __init__(self) -> None:
        self.stack: list[Fp8Stats] = []


ACTIVE = _Active()


def active_stats() -> Fp8Stats | None:
    """The innermost :class:`Fp8Stats` entered in this thread (None when none is).

    Example:
        >>> active_stats() is None
        True

    Host sync: none.
    """
    stack = ACTIVE.stack
    return stack[-1] if stack else None


class Fp8Stats:
    """Records what every fp8 matmul does, per module and operand, while it is entered.

    Enter it around the forward pass (with a ``"fp8"`` policy rule active); the backward pass of
    those forwards records into it too, wherever it runs. Values stay on the device (no host sync
    per step) and accumulate until :meth:`reset`: amax is the maximum seen, scale the minimum,
    saturated/flushed fractions and non-finite counts cover every cast. A checkpointed module's
    recomputation in backward is not counted twice.

    Example:
        >>> import torch
        >>> import mixprec
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16))
        >>> stats = mixprec.Fp8Stats()
        >>> with stats, mixprec.autocast("cpu", torch.bfloat16, policy="nn.Linear=fp8"):
        ...     loss = model(torch.randn(4, 16)).float().sum()
        >>> loss.backward()
        >>> s = stats.read()["0"]
        >>> s.recipe, s.input.nonfinite, s.grad_output.elements > 0
        ('tensorwise', 0, True)

    Host sync: none, except :meth:`read` and :meth:`summary`.
    """

    def __init__(self) -> None:
        self._slots: dict[str, Slot] = {}

    def __enter__(self) -> Fp8Stats:
        ACTIVE.stack.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        ACTIVE.stack.remove(self)

    def slot(self, name: str, device: torch.device, recipe: str) -> Slot:
        """The slot of module ``name`` (created on first use). Host sync: none."""
        found = self._slots.get(name)
        if found is None:
            found = self._slots[name] = Slot(device, recipe)
        return found

    @property
    def names(self) -> list[str]:
        """Qualified names of the modules recorded so far. Host sync: none."""
        return list(self._slots)

    def tensor(self, name: str) -> torch.Tensor:
        """Module ``name``'s raw stats on its device: rows ``("input", "weight",
        "grad_output")``, columns ``("amax", "scale", "saturated", "flushed", "nonfinite",
        "elements")`` with counts (not fractions): a copy, on the device.

        Host sync: none.
        """
        return self._slots[name].data.clone()

    def reset(self) -> None:
        """Forget everything recorded. Host sync: none."""
        self._slots.clear()

    def read(self) -> dict[str, Fp8ModuleStats]:
        """Every module's stats as Python numbers.

        Host sync: one (all modules are copied to the host together).
        """
        if not self._slots:
            return {}
        names = list(self._slots)
        host = torch.stack([self._slots[n].data.cpu() for n in names]).tolist()
        return {
            n: _module_stats(self._slots[n].recipe, rows)
            for n, rows in zip(names, host, strict=True)
        }

    def summary(self) -> str:
        """A text table, one line per module and operand.

        Host sync: one (through :meth:`read`).
        """
        lines = [
            f"{'module':<24} {'operand':<12} {'amax':>10} {'scale':>10} "
            f"{'saturated':>10} {'flushed':>9} {'nonfinite':>9}"
        ]
        for name, mod in self.read().items():
            for op in OPERANDS:
                s: Fp8CastStats = getattr(mod, op)
                lines.append(
                    f"{name or '<model>':<24} {op:<12} {s.amax:>10.4g} {s.scale:>10.4g} "
                    f"{s.saturated:>10.3%} {s.flushed:>9.3%} {s.nonfinite:>9d}"
                )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Fp8Stats(modules={self.names})"


def _module_stats(recipe: str, rows: list[list[float]]) -> Fp8ModuleStats:
    def one(row: list[float]) -> Fp8CastStats:
        amax, scale, sat, flushed, nonfinite, n = row
        frac = (lambda c: c / n) if n else (lambda c: 0.0)
        return Fp8CastStats(
            amax if n else 0.0,
            scale if n else 0.0,
            frac(sat),
            frac(flushed),
            int(nonfinite),
            int(n),
        )

    return Fp8ModuleStats(recipe, *(one(r) for r in rows))
