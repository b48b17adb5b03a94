"""The scale update rule, written once, for Python numbers and for device tensors alike.

:func:`next_scale` is the rule. It is written against a handful of primitive operations
(:class:`_Ops`): :data:`HOST` implements them on Python numbers, :data:`DEVICE` on 0-d tensors.
The host mirror is therefore the device rule itself, run on other values: exact by construction,
as long as the primitives agree (a product in float64 rounded once to float32, ``isfinite``,
``where``, ``min``/``max``), which the property tests check.

On a device with torch's ``_amp_update_scale_`` kernel and with torch's settings (hysteresis 1, no
``max_scale``), :func:`advance_tensors_` runs that kernel instead of the dozen small kernels of the
general form: it *is* torch's rule, so the trajectory is bit-identical to ``torch.amp.GradScaler``
(the property tests hold :func:`next_scale` to it). The only difference is the floor: the scale
never goes below the smallest normal float32, where torch's reaches 0 and every later step is
skipped silently.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from mixprec._src.devices import caps
from mixprec._src.scaling.config import INT32_MAX, ScalerConfig, to_f32

T = TypeVar("T")


@dataclass(frozen=True)
class Values:
    """The scale and its companions as Python numbers.

    Attributes:
        scale: the scale, a float32 value.
        growth_tracker: clean iterations since the last growth or overflow.
        overflow_streak: consecutive overflowing iterations; drives hysteresis.
        counters: ``(iterations, overflows, growths, backoffs)``.
    """

    scale: float
    growth_tracker: int = 0
    overflow_streak: int = 0
    counters: tuple[int, int, int, int] = (0, 0, 0, 0)


@dataclass
class Tensors:
    """The same values on a device: four 0-d tensors and an int64 vector of the counters."""

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    overflow_streak: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def create(cls, values: Values, device: torch.device) -> Tensors:
        """Fresh tensors holding ``values`` on ``device``. Host sync: none."""
        return cls(
            scale=torch.full((), values.scale, dtype=torch.float32, device=device),
            growth_tracker=torch.full((), values.growth_tracker, dtype=torch.int32, device=device),
            overflow_streak=torch.full(
                (), values.overflow_streak, dtype=torch.int32, device=device
            ),
            counters=torch.tensor(values.counters, dtype=torch.int64, device=device),
        )

    def write(self, values: Values) -> None:
        """Store ``values`` (a few ``fill_`` and one copy; no host sync)."""
        self.scale.fill_(values.scale)
        self.growth_tracker.fill_(values.growth_tracker)
        self.overflow_streak.fill_(values.overflow_streak)
        self.counters.copy_(torch.tensor(values.counters, dtype=torch.int64))

    def read(self) -> Values:
        """Every value, exactly, in one read (the scale travels as its float32 bits).

        Host sync: one off the host.
        """
        bits = self.scale.reshape(1).view(torch.int32).long()
        small = torch.stack([self.growth_tracker, self.overflow_streak]).long()
        it, overflows, growths, backoffs, tracker, streak, scale_bits = torch.cat(
            [self.counters, small, bits]
        ).tolist()
        scale = struct.unpack("f", struct.pack("i", scale_bits))[0]
        return Values(scale, tracker, streak, (it, overflows, growths, backoffs))


class _Ops(Generic[T]):
    """The primitives the rule is written with (``T``: Python numbers, or 0-d tensors)."""

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def both(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def either(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def negate(self, a: Any) -> Any:
        raise NotImplementedError

    def reaches(self, count: Any, bound: int) -> Any:
        """``count >= bound`` for an int32 count and any int bound."""
        raise NotImplementedError

    def count_up(self, count: Any) -> Any:
        """``count + 1``, saturating at the int32 maximum (an interval beyond it never ends)."""
        raise NotImplementedError

    def times(self, scale: Any, factor: float) -> Any:
        """``float32(float64(scale) * factor)``: one rounding, as torch's kernel does."""
        raise NotImplementedError

    def isfinite(self, x: Any) -> Any:
        raise NotImplementedError

    def clamp(self, x: Any, low: float, high: float | None) -> Any:
        raise NotImplementedError


class _HostOps(_Ops[float]):
    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return a if cond else b

    def both(self, a: Any, b: Any) -> Any:
        return a and b

    def either(self, a: Any, b: Any) -> Any:
        return a or b

    def negate(self, a: Any) -> Any:
        return not a

    def reaches(self, count: Any, bound: int) -> Any:
        return count >= bound

    def count_up(self, count: Any) -> Any:
        return min(count + 1, INT32_MAX)

    def times(self, scale: Any, factor: float) -> Any:
        return to_f32(scale * factor)

    def isfinite(self, x: Any) -> Any:
        return math.isfinite(x)

    def clamp(self, x: Any, low: float, high: float | None) -> Any:
        return max(x, low) if high is None else min(max(x, low), high)


class _DeviceOps(_Ops[torch.Tensor]):
    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return torch.where(cond, a, b)

    def both(self, a: Any, b: Any) -> Any:
        return a & b

    def either(self, a: Any, b: Any) -> Any:
        return a | b

    def negate(self, a: Any) -> Any:
        return ~a

    def reaches(self, count: Any, bound: int) -> Any:
        if bound > INT32_MAX:  # an int32 count never gets there (and the scalar would wrap)
            return torch.zeros_like(count, dtype=torch.bool)
        return count >= bound

    def count_up(self, count: Any) -> Any:
        return torch.where(count < INT32_MAX, count + 1, count)

    def times(self, scale: Any, factor: float) -> Any:
        return (scale.to(caps(scale.device).wide_float) * factor).float()

    def isfinite(self, x: Any) -> Any:
        return torch.isfinite(x)

    def clamp(self, x: Any, low: float, high: float | None) -> Any:
        return x.clamp(min=low, max=high)


HOST: _Ops[float] = _HostOps()
DEVICE: _Ops[torch.Tensor] = _DeviceOps()


def next_scale(
    scale: Any, tracker: Any, streak: Any, overflow: Any, config: ScalerConfig, ops: _Ops[Any]
) -> tuple[Any, Any, Any]:
    """The rule: ``(scale, growth_tracker, overflow_streak)`` after one iteration.

    An overflow (``overflow`` true) counts towards the streak and resets the tracker; on the
    ``hysteresis``-th consecutive one the scale is multiplied by ``backoff_factor``. A clean
    iteration resets the streak; on the ``growth_interval``-th the scale is multiplied by
    ``growth_factor`` (capped at ``max_scale``; refused if not finite) and the tracker resets
    (also when the growth was refused, as in torch). The result stays within
    ``[floor, max_scale]``.
    """
    streak = ops.where(overflow, ops.count_up(streak), 0)
    tracker = ops.count_up(tracker)
    at_interval = ops.both(ops.negate(overflow), ops.reaches(tracker, config.growth_interval))
    grown = ops.times(scale, config.growth_factor)
    if config.max_scale is not None:
        grown = ops.clamp(grown, 0.0, config.max_scale)
    grows = ops.both(at_interval, ops.isfinite(grown))
    shrinks = ops.both(overflow, ops.reaches(streak, config.hysteresis))
    shrunk = ops.times(scale, config.backoff_factor)
    scale = ops.where(shrinks, shrunk, ops.where(grows, grown, scale))
    tracker = ops.where(ops.either(overflow, at_interval), 0, tracker)
    return ops.clamp(scale, config.floor, config.max_scale), tracker, streak


def advance_values(values: Values, overflow: bool, config: ScalerConfig) -> Values:
    """:func:`next_scale` on Python numbers, with the counters. Host sync: none."""
    scale, tracker, streak = next_scale(
        values.scale, values.growth_tracker, values.overflow_streak, overflow, config, HOST
    )
    return Values(scale, tracker, streak, _counted(values, scale, overflow))


def _counted(before: Values, scale: float, overflow: bool) -> tuple[int, int, int, int]:
    it, overflows, growths, backoffs = before.counters
    grew, shrank = scale > before.scale, scale < before.scale
    return (it + 1, overflows + overflow, growths + grew, backoffs + shrank)


def write_advance_(tensors: Tensors, before: Values, after: Values) -> None:
    """Store an update computed by :func:`advance_values` into ``tensors``.

    Where tensors live in host memory this replaces :func:`advance_tensors_`: the host already
    knows the outcome, and three ``fill_`` and one ``add_`` cost less than the comparisons of
    the device form.

    Host sync: none (meant for tensors in host memory).
    """
    tensors.scale.fill_(after.scale)
    tensors.growth_tracker.fill_(after.growth_tracker)
    tensors.overflow_streak.fill_(after.overflow_streak)
    delta = tuple(a - b for a, b in zip(after.counters, before.counters, strict=True))
    tensors.counters.add_(_counter_delta(delta))


def advance_tensors_(
    tensors: Tensors, found_inf: torch.Tensor, config: ScalerConfig, *, clamp: bool = True
) -> torch.Tensor:
    """:func:`next_scale` on the device, in place; returns the scale it had before (a copy).

    Args:
        tensors: the state to update (all on one device).
        found_inf: 0-d float32 tensor on that device; any non-zero value (NaN included) is an
            overflow.
        config: growth, backoff, interval, bounds and hysteresis.
        clamp: apply the floor; the caller may pass False when it knows that torch's kernel
            cannot reach it (no ``max_scale`` and a scale far above the floor).

    Host sync: none.
    """
    old = tensors.scale.clone()
    overflow = found_inf != 0
    if config.is_torch_rule and caps(old.device).amp_kernels:
        torch._amp_update_scale_(
            tensors.scale,
            tensors.growth_tracker,
            found_inf,
            config.growth_factor,
            config.backoff_factor,
            config.growth_interval,
        )
        tensors.overflow_streak.clamp_(max=INT32_MAX - 1).add_(1).mul_(overflow)  # saturating
        if clamp:
            tensors.scale.clamp_(min=config.floor)
    else:
        scale, tracker, streak = next_scale(
            old, tensors.growth_tracker, tensors.overflow_streak, overflow, config, DEVICE
        )
        tensors.scale.copy_(scale)
        tensors.growth_tracker.copy_(tracker)
        tensors.overflow_streak.copy_(streak)
    grew, shrank = tensors.scale > old, tensors.scale < old
    tensors.counters.add_(torch.stack([torch.ones_like(overflow), overflow, grew, shrank]))
    return old


@functools.cache
def _counter_delta(delta: tuple[int, int, int, int]) -> torch.Tensor:
    """The few possible per-iteration increments, built once (``torch.tensor`` costs ~9 us)."""
    return torch.tensor(delta, dtype=torch.int64)
