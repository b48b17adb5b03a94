"""``Fp8Stats``: per-module, per-operand cast statistics of every low-precision recipe (fp8,
MXFP8, 128-blocks, NVFP4), device tensors until read."""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from mixprec._src.devices import caps
from mixprec.errors import ConfigError

OPERANDS = ("input", "weight", "grad_output")
# The columns of one cast's statistics row (``casts.cast_stats`` fills them): amax is
# max-reduced, scale min-reduced, scale_max max-reduced, the counts summed.
STAT_COLUMNS = (
    "amax",
    "scale",
    "scale_max",
    "saturated",
    "flushed",
    "nonfinite",
    "elements",
    "blocks",
    "block_saturated",
    "block_underflow",
)


@dataclass(frozen=True)
class Fp8CastStats:
    """What the casts of one operand of one module did, since the stats were last reset.

    A scale here is what values are multiplied by before the cast (``fmt_max / amax`` for a
    plain fp8 cast), whatever the recipe stores; one per tensor, row or block.

    Attributes:
        amax: the largest magnitude seen (NaN or inf once a non-finite value arrived).
        scale: the smallest scale used (0 or NaN after a non-finite amax).
        saturated: fraction of cast elements at the format's largest magnitude.
        flushed: fraction of cast elements that were non-zero and became zero (in blocks with
            a finite amax: a block holding an inf is counted in ``nonfinite``, not here).
        nonfinite: number of inf/NaN elements seen in the high-precision operand.
        elements: number of elements cast (an operand cast for two matmuls counts twice).
        scale_max: the largest scale among blocks holding non-zero finite values.
        blocks: number of scales used (1 per tensorwise cast).
        block_saturated: fraction of blocks whose scale hit the top of its format (their
            values saturate; E8M0 and NVFP4's E4M3 block scales have a range).
        block_underflow: fraction of blocks holding non-zero values whose scale hit the
            bottom of its format (their values are flushed or lose precision).
    """

    amax: float
    scale: float
    saturated: float
    flushed: float
    nonfinite: int
    elements: int
    scale_max: float = 0.0
    blocks: int = 0
    block_saturated: float = 0.0
    block_underflow: float = 0.0

    @property
    def spread(self) -> float:
        """How many powers of two the scales span: ``log2(scale_max / scale)`` (0 with one
        scale or none). Host sync: none."""
        if not (self.scale > 0 and self.scale_max > 0):
            return 0.0
        return max(0.0, math.log2(self.scale_max / self.scale))


@dataclass(frozen=True)
class Fp8ModuleStats:
    """The statistics of one module under one recipe: one :class:`Fp8CastStats` per operand,
    and the path its matmuls took.

    ``grad_output`` stays empty (``elements == 0``) until a backward pass ran. ``path`` is
    ``"hardware"`` when every matmul recorded ran on ``torch._scaled_mm``, ``"emulated"`` when
    none did (dequantized values and an fp32 matmul), ``"mixed"`` otherwise (shapes that are not
    multiples of 16 fall back to the emulation). ``gathered_bytes``: what this rank put into the
    weight's low-precision all-gathers (``mixprec.distributed.gather_low_precision``) while the
    stats were entered; the weight's casts then happen on the shards, not recorded here.
    """

    recipe: str
    input: Fp8CastStats
    weight: Fp8CastStats
    grad_output: Fp8CastStats
    path: str = "emulated"
    gathered_bytes: int = 0


class Slot:
    """The accumulating stats of one module under one recipe: a tensor with rows
    :data:`OPERANDS` and columns :data:`STAT_COLUMNS`, and the matmuls counted per path.

    Host sync: none.
    """

    __slots__ = ("data", "emulated", "gathered", "hardware", "recipe")

    def __init__(self, device: torch.device, recipe: str) -> None:
        self.recipe = recipe
        self.hardware = self.emulated = self.gathered = 0
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
                torch.maximum(cur[2:3], row[2:3]),
                cur[3:] + row[3:],
            ]
        )
        cur.copy_(merged)

    def count_path(self, hardware: bool) -> None:
        """Count one matmul on the hardware or the emulated path. Host sync: none."""
        if hardware:
            self.hardware += 1
        else:
            self.emulated += 1

    @property
    def path(self) -> str:
        """``"hardware"``, ``"emulated"`` or ``"mixed"``. Host sync: none."""
        if self.hardware and self.emulated:
            return "mixed"
        return "hardware" if self.hardware else "emulated"


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
    """Records what every low-precision matmul does, per module and operand, while entered.

    Enter it around the forward pass (with an fp8-family policy rule active: ``"fp8"``,
    ``"fp8:blockwise"``, ``"mxfp8"``, ``"nvfp4"``...); the backward pass of those forwards records
    into it too, wherever it runs. Values stay on the device (no host sync per step) and
    accumulate until :meth:`reset`: amax is the maximum seen, scale the minimum (and scale_max
    the maximum), saturated/flushed fractions, block-scale clamping and non-finite counts cover
    every cast, and each module says which path its matmuls took (``path``: hardware or
    emulated). A checkpointed module's recomputation in backward is not counted twice.

    A module is recorded once per model and recipe: run under two recipes while one
    ``Fp8Stats`` is entered, it has two records, keyed ``"name:recipe"`` (a module seen under
    one recipe only is keyed by its name). Two models run in one region (a GAN's generator and
    discriminator, a teacher and a student) keep separate records; where both have a module of
    one name, each is keyed ``"Model/name"`` with its model's class name (``"Model#1/name"`` for
    a second model of the same class). A backward records into the records of its forward,
    whenever it runs: after the block exited too, and checkpoint recomputation included.

    Example:
        >>> import torch
        >>> import mixprec
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16))
        >>> stats = mixprec.Fp8Stats()
        >>> with stats, mixprec.autocast("cpu", torch.bfloat16, policy="nn.Linear=fp8"):
        ...     loss = model(torch.randn(4, 16)).float().sum()
        >>> loss.backward()
        >>> s = stats.read()["0"]
        >>> s.recipe, s.path, s.input.nonfinite, s.grad_output.elements > 0
        ('tensorwise', 'emulated', 0, True)

    Host sync: none, except :meth:`read` and :meth:`summary`.
    """

    def __init__(self) -> None:
        self._slots: dict[tuple[int, str, str], Slot] = {}
        self._models: dict[int, tuple[Any, str]] = {}  # model key -> (weak reference, label)

    def __enter__(self) -> Fp8Stats:
        ACTIVE.stack.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self not in ACTIVE.stack:
            raise ConfigError(
                "Fp8Stats left without being entered (or left twice): use it as "
                "`with stats:` around the forward pass"
            )
        ACTIVE.stack.remove(self)

    def slot(self, name: str, device: torch.device, recipe: str, model: object = None) -> Slot:
        """The slot of module ``name`` of ``model`` (the module called at the top of the region)
        under ``recipe`` (created on first use).

        Host sync: none.
        """
        key = (self._model_key(model), name, recipe)
        found = self._slots.get(key)
        if found is None:
            found = self._slots[key] = Slot(device, recipe)
        return found

    def _model_key(self, model: object) -> int:
        """A number per model seen (0: none given), each labelled by its class name."""
        if model is None:
            return 0
        for key, (ref, _) in self._models.items():
            if ref() is model:
                return key
        label = type(model).__name__
        same = sum(1 for _, lab in self._models.values() if lab.partition("#")[0] == label)
        if same:
            label = f"{label}#{same}"
        key = len(self._models) + 1
        self._models[key] = (weakref.ref(model), label)
        return key

    def _keys(self) -> dict[str, Slot]:
        """Each record under its key: the module's name; ``"Model/name"`` when two models have a
        module of that name; ``":recipe"`` appended for a module recorded under several recipes."""
        models_of: dict[str, set[int]] = {}
        recipes_of: dict[tuple[int, str], int] = {}
        for model, name, _ in self._slots:
            models_of.setdefault(name, set()).add(model)
            recipes_of[(model, name)] = recipes_of.get((model, name), 0) + 1
        keyed = {}
        for (model, name, recipe), slot in self._slots.items():
            key = name
            if len(models_of[name]) > 1:
                key = f"{self._models[model][1] if model else '?'}/{name}"
            if recipes_of[(model, name)] > 1:
                key = f"{key}:{recipe}"
            keyed[key] = slot
        return keyed

    @property
    def names(self) -> list[str]:
        """The keys of the records so far: qualified module names (``"name:recipe"`` for a module
        recorded under several recipes). Host sync: none."""
        return list(self._keys())

    def tensor(self, name: str) -> torch.Tensor:
        """The raw stats of record ``name`` on its device: rows ``("input", "weight",
        "grad_output")``, columns ``("amax", "scale", "scale_max", "saturated", "flushed",
        "nonfinite", "elements", "blocks", "block_saturated", "block_underflow")`` with counts
        (not fractions): a copy, on the device.

        Host sync: none.
        """
        return self._keys()[name].data.clone()

    def reset(self) -> None:
        """Forget everything recorded. Host sync: none."""
        self._slots.clear()
        self._models.clear()

    def read(self) -> dict[str, Fp8ModuleStats]:
        """Every record's stats as Python numbers, keyed as :attr:`names`.

        Host sync: one (all modules are copied to the host together).
        """
        keyed = self._keys()
        if not keyed:
            return {}
        host = torch.stack([slot.data.cpu() for slot in keyed.values()]).tolist()
        return {
            key: _module_stats(slot, rows)
            for (key, slot), rows in zip(keyed.items(), host, strict=True)
        }

    def summary(self) -> str:
        """A text table, one line per module and operand that was cast (an operand a rule per
        matmul left in high precision, or a backward not run yet, has no line), module names
        wrapped at their dots to the first column's width, and a legend line.

        Host sync: one (through :meth:`read`).
        """
        rows = [list(_HEADER)]
        for name, mod in self.read().items():
            cast = [op for op in OPERANDS if getattr(mod, op).elements]
            names = wrap_name(name or "<model>", _NAME)
            for i, op in enumerate(cast):
                s: Fp8CastStats = getattr(mod, op)
                numbers = (s.amax, s.scale, s.spread, s.saturated, s.flushed)
                rows.append(
                    [
                        names[i] if i < len(names) else "",
                        mod.recipe,
                        mod.path,
                        op,
                        *(f"{v:{f}}" for v, f in zip(numbers, _FORMATS, strict=True)),
                        f"{s.block_saturated:.2%}",
                        f"{s.block_underflow:.2%}",
                        str(s.nonfinite),
                    ]
                )
            rows += [[n] + [""] * (len(_HEADER) - 1) for n in names[len(cast) :]]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
        lines = [
            " ".join(
                c.ljust(w) if i < 4 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
            for r in rows
        ]
        return "\n".join([*(line.rstrip() for line in lines), *_SUMMARY_LEGEND])

    def __repr__(self) -> str:
        return f"Fp8Stats(modules={self.names})"


_NAME = 24  # the widest module name column of :meth:`Fp8Stats.summary`
_FORMATS = (".4g", ".4g", ".1f", ".2%", ".3%")
_HEADER = (
    "module",
    "recipe",
    "path",
    "operand",
    "amax",
    "scale",
    "spread",
    "at-max",
    "flushed",
    "blk-sat",
    "blk-under",
    "nonfinite",
)
_SUMMARY_LEGEND = (
    "at-max: values cast to the format's largest magnitude (its top bin: with amax scaling the "
    "largest",
    "value lands there, so a few is healthy, not clipping); flushed: non-zero values cast to 0; "
    "spread:",
    "log2 of the largest over the smallest scale; blk-sat, blk-under: blocks whose scale hit "
    "the top or",
    "the bottom of its format; nonfinite: inf/NaN values in the high-precision operand",
)


def wrap_name(name: str, width: int) -> list[str]:
    """``name`` in lines of at most ``width``, broken after dots (a longer part is cut): how
    the stats summary and the advice table wrap a module name.

    Example:
        >>> wrap_name("blocks.11.attn.proj", 10)
        ['blocks.11.', 'attn.proj']

    Host sync: none.
    """
    parts = [p + "." for p in name.split(".")]
    parts[-1] = parts[-1][:-1]
    chunks = [part[i : i + width] for part in parts for i in range(0, len(part), width)]
    lines = [""]
    for chunk in chunks:
        if lines[-1] and len(lines[-1]) + len(chunk) > width:
            lines.append("")
        lines[-1] += chunk
    return lines


def _module_stats(slot: Slot, rows: list[list[float]]) -> Fp8ModuleStats:
    def one(row: list[float]) -> Fp8CastStats:
        amax, scale, scale_max, sat, flushed, nonfinite, n, blocks, high, low = row
        frac = (lambda c: c / n) if n else (lambda c: 0.0)
        per_block = (lambda c: c / blocks) if blocks else (lambda c: 0.0)
        return Fp8CastStats(
            amax if n else 0.0,
            scale if n else 0.0,
            frac(sat),
            frac(flushed),
            int(nonfinite),
            int(n),
            scale_max if n else 0.0,
            int(blocks),
            per_block(high),
            per_block(low),
        )

    inp, weight, grad_output = (one(r) for r in rows)
    return Fp8ModuleStats(slot.recipe, inp, weight, grad_output, slot.path, slot.gathered)
