"""What the host knows about the scale without reading the device, and the counters users read.

The device tensors (:class:`~mixprec.scaler.rule.ScaleState`) are the truth. The host keeps a
mirror (:class:`~mixprec.scaler.rule.HostScale`) that stays exact as long as it learns whether each
iteration overflowed; a non-fused ``step`` reads that anyway, and on the CPU the device *is* the
host, so reading costs nothing. When an iteration's outcome is unknown (fused optimizers on an
accelerator), the mirror turns into a lower bound on the scale, refreshed the next time something
reads the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mixprec.scaler.config import ScalerConfig
from mixprec.scaler.rule import HostScale, ScaleState

__all__ = ["HostMirror", "ScalerStats"]

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

    def resync(self, state: ScaleState) -> HostScale:
        """Read the device state (one host sync off the CPU) and make the mirror exact."""
        values = torch.stack(
            [state.scale.double(), state.growth_tracker.double(), state.overflow_streak.double()]
        ).tolist()
        self.exact = HostScale(values[0], int(values[1]), int(values[2]))
        self.lower_bound = self.exact.scale
        return self.exact

    def advance(self, state: ScaleState, overflow: bool | None, config: ScalerConfig) -> None:
        """Follow one update: exactly if ``overflow`` is known or the state lives on the CPU."""
        if state.scale.device.type == "cpu":
            self.resync(state)
        elif overflow is not None and self.exact is not None:
            self.exact = self.exact.advance(overflow, config)
            self.lower_bound = self.exact.scale
        else:
            self.exact = None
            shrunk = self.lower_bound * config.backoff_factor * _ROUNDING_MARGIN
            self.lower_bound = max(shrunk, config.floor)

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
        return not self.lower_bound >= 1.0 or math.isnan(self.lower_bound)
