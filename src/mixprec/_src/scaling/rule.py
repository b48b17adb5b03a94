"""The scale update rule, written once, for Python numbers and for device tensors alike.

:func:`next_scale` is the rule. It is written against a handful of primitive operations
(:class:`Ops`): :data:`DEVICE` implements them on 0-d tensors; on Python numbers the rule is
*compiled* (:func:`host_rule`): traced once per :class:`~mixprec.ScalerConfig` with symbolic
values, each primitive written as the Python expression it is on numbers (``where`` as ``a if c
else b``, ``both`` as ``a & b``, products in float64 rounded once by ``to_f32``), into one flat
function. The host view is therefore the device rule itself, run on other values: exact by
construction, as long as the primitives agree, which the property tests check. Compiling matters
because the host rule runs right after the optimizer step, when the interpreter's caches are
cold: there every distinct function called costs microseconds, and the compiled rule is one.

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
import operator
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch

from mixprec._src.devices import caps
from mixprec._src.scaling.config import INT32_MAX, ScalerConfig, to_f32


class Values(NamedTuple):
    """The scale and its companions as Python numbers (a named tuple: cheap to make).

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


class Ops(NamedTuple):
    """The primitives the rule is written with.

    :data:`DEVICE` implements them on 0-d tensors, without reading anything back;
    :func:`host_rule` writes them as Python expressions on numbers.
    """

    where: Callable[[Any, Any, Any], Any]
    both: Callable[[Any, Any], Any]
    either: Callable[[Any, Any], Any]
    negate: Callable[[Any], Any]
    at_least: Callable[[Any, int], Any]  # ``count >= bound`` for an int32 count, any int bound
    minimum: Callable[[Any, float], Any]
    maximum: Callable[[Any, float], Any]
    isfinite: Callable[[Any], Any]
    wide: Callable[[Any], Any]  # to the widest float (float64 where the device has it)
    f32: Callable[[Any], Any]  # round to float32


def _tensor_at_least(count: torch.Tensor, bound: int) -> torch.Tensor:
    if bound > INT32_MAX:  # an int32 count never gets there (and the scalar would wrap)
        return torch.zeros_like(count, dtype=torch.bool)
    return count >= bound


def _tensor_where(cond: torch.Tensor, a: Any, b: Any) -> torch.Tensor:
    """``torch.where``; two Python floats (the factors) stay float64, as torch's kernel keeps
    them, instead of becoming float32."""
    if isinstance(a, float) and not isinstance(b, torch.Tensor):
        a = torch.tensor(a, dtype=caps(cond.device).wide_float, device=cond.device)
    return torch.where(cond, a, b)


DEVICE = Ops(
    where=_tensor_where,
    both=operator.and_,
    either=operator.or_,
    negate=operator.invert,
    at_least=_tensor_at_least,
    minimum=lambda x, high: x.clamp(max=high),
    maximum=lambda x, low: x.clamp(min=low),
    isfinite=torch.isfinite,
    wide=lambda x: x.to(caps(x.device).wide_float),
    f32=lambda x: x.float(),
)


def next_scale(
    scale: Any, tracker: Any, streak: Any, overflow: Any, config: ScalerConfig, ops: Ops
) -> tuple[Any, Any, Any]:
    """The rule: ``(scale, growth_tracker, overflow_streak)`` after one iteration.

    An overflow (``overflow`` true) counts towards the streak and resets the tracker; on the
    ``hysteresis``-th consecutive one the scale is multiplied by ``backoff_factor``. A clean
    iteration resets the streak; on the ``growth_interval``-th the scale is multiplied by
    ``growth_factor`` (capped at ``max_scale``; refused if not finite) and the tracker resets
    (also when the growth was refused, as in torch). Products are taken in float64 and rounded
    once to float32, as torch's kernel does; the counts saturate at the int32 maximum. The
    result stays within ``[floor, max_scale]``.
    """
    streak = ops.where(overflow, _count_up(streak, ops), 0)
    tracker = _count_up(tracker, ops)
    at_interval = ops.both(ops.negate(overflow), ops.at_least(tracker, config.growth_interval))
    shrinks = ops.both(overflow, ops.at_least(streak, config.hysteresis))
    # One product: by the backoff, by the growth, or by 1 (exact: the scale is a float32).
    factor = ops.where(
        shrinks, config.backoff_factor, ops.where(at_interval, config.growth_factor, 1.0)
    )
    candidate = ops.f32(ops.wide(scale) * factor)
    if config.max_scale is not None:
        candidate = ops.minimum(candidate, config.max_scale)
    scale = ops.where(ops.isfinite(candidate), candidate, scale)  # growth to inf is refused
    tracker = ops.where(ops.either(overflow, at_interval), 0, tracker)
    scale = ops.maximum(scale, config.floor)
    if config.max_scale is not None:
        scale = ops.minimum(scale, config.max_scale)
    return scale, tracker, streak


def _count_up(count: Any, ops: Ops) -> Any:
    """``count + 1``, saturating at the int32 maximum (an interval beyond it never ends)."""
    return ops.where(ops.at_least(count, INT32_MAX), count, count + 1)


def _advance(values: Values, overflow: Any, config: ScalerConfig, ops: Ops) -> Values:
    """:func:`next_scale` with the counters: one whole update of the host view."""
    old = values.scale
    scale, tracker, streak = next_scale(
        old, values.growth_tracker, values.overflow_streak, overflow, config, ops
    )
    it, overflows, growths, backoffs = values.counters
    counters = (it + 1, overflows + overflow, growths + (scale > old), backoffs + (scale < old))
    return Values(scale, tracker, streak, counters)


HostRule = Callable[[Values, bool], Values]


@functools.lru_cache(maxsize=64)
def host_rule(config: ScalerConfig) -> HostRule:
    """The rule and the counters for ``config``, compiled into one flat function of
    ``(values, overflow)`` on Python numbers; ``overflow`` is a bool.

    :func:`next_scale` is run once on symbolic values (:class:`_Traced`); each primitive and
    operator it applies becomes one line of the function (its ``source`` attribute). A branch on
    a traced value would bake one outcome into the function, so it raises instead.

    Host sync: none.
    """
    trace = _Trace()
    inputs = [_Traced(name, trace) for name in _INPUTS]
    *state, flag = inputs
    before = Values._make([*state[:3], tuple(state[3:])])
    after = _advance(before, flag, config, _traced_ops(trace))
    result = ", ".join(map(trace.name, after[:3]))
    counters = ", ".join(map(trace.name, after.counters))
    make, cls = trace.name(tuple.__new__), trace.name(Values)
    lines = [
        f"def build({', '.join(trace.constants)}):",
        "    def advance(values, overflow):",
        f"        {', '.join(_INPUTS[:3])}, ({', '.join(_INPUTS[3:7])}) = values",
        *(f"        {line}" for line in trace.lines),
        f"        return {make}({cls}, ({result}, ({counters})))",
        "    return advance",
    ]
    source = "\n".join(lines) + "\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, "<mixprec host rule>", "exec"), namespace)  # our own trace only
    advance = namespace["build"](**trace.constants)
    advance.source = source
    return cast("HostRule", advance)


_INPUTS = (
    *("scale", "tracker", "streak", "iterations", "overflows", "growths", "backoffs"),
    "overflow",
)


class _Trace:
    """The lines of a rule being compiled and the objects they use (passed in by name)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.constants: dict[str, Any] = {}

    def name(self, value: Any) -> str:
        """The name of a traced value; a number as its literal (``repr`` round-trips exactly);
        anything else as a new constant named after it."""
        if isinstance(value, _Traced):
            return value.name
        if type(value) in (int, bool) or (type(value) is float and math.isfinite(value)):
            return repr(value)
        key = f"{getattr(value, '__name__', 'constant').strip('_')}_{len(self.constants)}"
        self.constants[key] = value
        return key

    def line(self, template: str, *args: Any) -> _Traced:
        """A new local ``v<n> = <template filled with the names of args>``."""
        out = _Traced(f"v{len(self.lines)}", self)
        self.lines.append(f"{out.name} = " + template.format(*map(self.name, args)))
        return out


def _operator(template: str, reflected: bool = False) -> Callable[[_Traced, Any], _Traced]:
    """A binary operator of :class:`_Traced`: one new line ``template`` of both operands."""

    def apply(self: _Traced, other: Any) -> _Traced:
        return self.trace.line(template, *((other, self) if reflected else (self, other)))

    return apply


class _Traced:
    """A value in a rule being compiled: the name of a local of the generated function."""

    __slots__ = ("name", "trace")

    def __init__(self, name: str, trace: _Trace) -> None:
        self.name = name
        self.trace = trace

    __add__ = _operator("{} + {}")
    __radd__ = _operator("{} + {}", reflected=True)
    __mul__ = _operator("{} * {}")
    __rmul__ = _operator("{} * {}", reflected=True)
    __gt__ = _operator("{} > {}")
    __lt__ = _operator("{} < {}")

    def __bool__(self) -> bool:
        raise TypeError(
            f"the rule branched on the traced value {self.name}: write the choice with "
            "ops.where so that both the device and the host form take it"
        )


def _traced_ops(trace: _Trace) -> Ops:
    """The primitives as the Python expressions they are on numbers (``min(a, b)`` is ``a``
    unless ``b < a``; ``max`` likewise), each applied to the names of its operands."""
    line = trace.line
    return Ops(
        where=lambda c, a, b: line("{1} if {0} else {2}", c, a, b),
        both=lambda a, b: line("{} & {}", a, b),
        either=lambda a, b: line("{} | {}", a, b),
        negate=lambda a: line("not {}", a),
        at_least=lambda count, bound: line("{} >= {}", count, bound),
        minimum=lambda x, high: line("{1} if {1} < {0} else {0}", x, high),
        maximum=lambda x, low: line("{1} if {1} > {0} else {0}", x, low),
        isfinite=lambda x: line("{}({})", math.isfinite, x),
        wide=lambda x: line("{}({})", float, x),
        f32=lambda x: line("{}({})", to_f32, x),
    )


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
