"""What the host knows about the scale without reading the device, and the counters users read.

The device tensors (:class:`~mixprec._src.scaling.rule.ScaleState`) are the truth. The host
keeps a mirror (:class:`~mixprec._src.scaling.rule.HostScale`) that stays exact as long as it
learns whether each iteration overflowed; a non-fused ``step`` reads that anyway, and on the CPU
the device *is* the host, so reading costs nothing. When an iteration's outcome is unknown
(fused optimizers on an accelerator), the mirror turns into a lower bound on the scale,
refreshed the next time something reads the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mixprec._src.scaling.config import ScalerConfig
from mixprec._src.scaling.rule import HostScale, ScaleState

# Backoff products are rounded to float32; shrinking the bound a little more keeps it a bound.
_ROUNDING_MARGIN = 1.0 - 2.0**-20


@dataclass(frozen=True)
class ScalerStats:
    """Counters since the scaler was created (or since the state dict it was loaded from).

    Attributes:
        iterations: calls to ``update()`` that applied the rule.
        steps_taken: iterations without an inf/NaN gradient.
        steps_skipped: iterations with one (their optimizer steps were skipped).
        consecutive_skips: skipped iterations in a row, up to the last one.
        growths: times the scale grew.
        backoffs: times the scale shrank.
        scale: the current scale.
    """

    iterations: int
    steps_taken: int
    steps_skipped: int
    consecutive_skips: int
    growths: int
    backoffs: int
    scale: float


class HostMirror:
    """The host's view of the scale: exact when possible, else a lower bound."""

    def __init__(self, scale: float, growth_tracker: int, overflow_streak: int) -> None:
        self.exact: HostScale | None = HostScale(scale, growth_tracker, overflow_streak)
        self.lower_bound = scale

    @property
    def lower_bound(self) -> float:
        """A value the scale is known to be >= (exact when :attr:`exact` is set)."""
        return self._lower_bound

    @lower_bound.setter
    def lower_bound(self, value: float) -> None:
        self._lower_bound = value
        # Kept as a bool for code that torch.compile traces: dynamo guards on what it reads,
        # and a bool has two values where the bound has one per scale (one recompile each).
        self._below_one = not value >= 1.0 or math.isnan(value)

    def resync(self, state: ScaleState) -> HostScale:
        """Read the device state (one host sync off the CPU) and make the mirror exact."""
        values = torch.stack(
            [state.scale.double(), state.growth_tracker.double(), state.overflow_streak.double()]
        ).tolist()
        self.exact = HostScale(values[0], int(values[1]), int(values[2]))
        self.lower_bound = self.exact.scale
        return self.exact

    def advance(
        self,
        state: ScaleState,
        overflow: bool | None,
        config: ScalerConfig,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """Follow one update: exactly if ``overflow`` is known or the state lives on the CPU.

        On the CPU an unknown ``overflow`` is read from ``found_inf`` (host memory: no sync,
        about a microsecond), which is cheaper than reading the whole state back.

        Under ``torch.compile`` the mirror neither reads the device (``tolist`` would break the
        graph) nor follows the rule on Python numbers (dynamo would guard on their values and
        recompile every iteration): it forgets the scale, keeping only the floor as a bound,
        until something outside the compiled region reads the device again.
        """
        if torch.compiler.is_compiling():
            self.exact = None
            self.lower_bound = config.floor
        elif overflow is None and state.scale.is_cpu and found_inf is not None:
            self.advance(state, bool(found_inf.item() != 0), config)
        elif overflow is not None and self.exact is not None:
            self.exact = self.exact.advance(overflow, config)
            self.lower_bound = self.exact.scale
        elif state.scale.is_cpu:
            self.resync(state)
        else:
            self.exact = None
            shrunk = self.lower_bound * config.backoff_factor * _ROUNDING_MARGIN
            self.lower_bound = max(shrunk, config.floor)

    def set_exact(self, exact: HostScale) -> None:
        """The host computed the state itself (the CPU rule): the mirror is that state."""
        self.exact = exact
        self.lower_bound = exact.scale

    def set_scale(self, scale: float | None) -> None:
        """After ``update(new_scale)``: exact for a float, unknown for a tensor."""
        if scale is None:
            self.exact = None
            self.lower_bound = 0.0
        elif self.exact is not None:
            self.exact = HostScale(scale, self.exact.growth_tracker, self.exact.overflow_streak)
            self.lower_bound = scale
        else:
            self.lower_bound = scale

    @property
    def scale_may_be_below_one(self) -> bool:
        """True unless the host can prove ``scale >= 1`` (then ``1/scale`` cannot overflow)."""
        return self._below_one


@dataclass(frozen=True)
class HistoryEntry:
    """One iteration of the scale history.

    Attributes:
        iteration: 1-based number of the update that ended the iteration.
        scale: the scale used during that iteration (the one its gradients were scaled by).
        skipped: whether the iteration's optimizer steps were skipped.
    """

    iteration: int
    scale: float
    skipped: bool


@dataclass(frozen=True)
class UpdateEvent:
    """What an update hook receives: device tensors, nothing read back to the host.

    Attributes:
        iteration: 1-based number of this update.
        scale: the scale after the update (0-d float32, the scaler's own tensor: do not modify).
        found_inf: the iteration's combined overflow flag (0-d float32, non-zero = overflow).
        skipped: ``found_inf != 0`` (0-d bool).
    """

    iteration: int
    scale: torch.Tensor
    found_inf: torch.Tensor
    skipped: torch.Tensor


class History:
    """A bounded ring of (scale, skipped) kept on the device until read."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._scales: torch.Tensor | None = None
        self._skips: torch.Tensor | None = None
        self._count = 0
        self._first_iteration = 1

    def record(self, iteration: int, scale: torch.Tensor, overflow: torch.Tensor) -> None:
        """Append one iteration (two tiny device copies). Host sync: none."""
        if self.capacity == 0:
            return
        if self._scales is None or self._skips is None:
            self._scales = torch.zeros(self.capacity, dtype=torch.float32, device=scale.device)
            self._skips = torch.zeros(self.capacity, dtype=torch.bool, device=scale.device)
            self._first_iteration = iteration
        slot = self._count % self.capacity
        self._scales[slot].copy_(scale)
        self._skips[slot].copy_(overflow)
        self._count += 1

    def entries(self) -> list[HistoryEntry]:
        """Oldest first. Host sync: one."""
        if self._scales is None or self._skips is None or self._count == 0:
            return []
        n = min(self._count, self.capacity)
        start = self._count - n
        order = [(start + k) % self.capacity for k in range(n)]
        scales = self._scales[order].tolist()
        skips = self._skips[order].tolist()
        first = self._first_iteration + start
        return [HistoryEntry(first + k, scales[k], skips[k]) for k in range(n)]

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        for key in ("_scales", "_skips"):
            tensor = state[key]
            state[key] = tensor.cpu() if isinstance(tensor, torch.Tensor) else None
        return state


def read_stats(state: ScaleState) -> ScalerStats:
    """All counters and the scale in one read. Host sync: one off the CPU."""
    values = torch.cat(
        [
            state.counters.double(),
            state.overflow_streak.double().reshape(1),
            state.scale.double().reshape(1),
        ]
    ).tolist()
    iterations, skipped, growths, backoffs, streak, scale = values
    return ScalerStats(
        iterations=int(iterations),
        steps_taken=int(iterations - skipped),
        steps_skipped=int(skipped),
        consecutive_skips=int(streak),
        growths=int(growths),
        backoffs=int(backoffs),
        scale=scale,
    )
