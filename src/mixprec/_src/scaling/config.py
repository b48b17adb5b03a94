"""Frozen, validated scaler settings.

Every bad value raises :class:`~mixprec.errors.ConfigError` naming the setting, the value and the
allowed range; setters on the scaler go through the same checks (``dataclasses.replace``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Any

from mixprec.errors import ConfigError

#: Smallest normal float32. The scale never goes below it, so ``1 / scale`` stays finite.
FP32_TINY = 2.0**-126
#: Largest finite float32.
FP32_MAX = 3.4028234663852886e38


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a real number, got {value!r} ({type(value).__name__}).")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}.")
    return value


def _integer(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(
            f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})."
        )
    if value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value}.")
    return int(value)


@dataclass(frozen=True)
class ScalerConfig:
    """The settings of a :class:`~mixprec.GradScaler`, checked on construction.

    Attributes:
        init_scale: first scale, finite and > 0.
        growth_factor: multiplier after ``growth_interval`` clean iterations, > 1.
        backoff_factor: multiplier after an overflow, in (0, 1).
        growth_interval: clean iterations needed before a growth, an int >= 1.
        min_scale: lower bound of the scale, or None (the floor is then the smallest normal
            float32, so the scale never reaches 0).
        max_scale: upper bound of the scale, or None (growth never reaches inf).
        hysteresis: back off only on the N-th consecutive overflowing iteration, an int >= 1.
        max_consecutive_skips: raise :class:`~mixprec.errors.ScaleCollapseError` on the N-th
            consecutive skipped iteration, or None to never raise.

    Example:
        >>> ScalerConfig(init_scale=1024.0, growth_interval=100).growth_interval
        100
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = None
    max_scale: float | None = None
    hysteresis: int = 1
    max_consecutive_skips: int | None = None

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__
        init = _number("init_scale", self.init_scale)
        if not 0 < init <= FP32_MAX:
            raise ConfigError(f"init_scale must be in (0, {FP32_MAX:g}] (a float32), got {init}.")
        growth = _number("growth_factor", self.growth_factor)
        if growth <= 1.0:
            raise ConfigError(f"growth_factor must be > 1.0, got {growth}.")
        backoff = _number("backoff_factor", self.backoff_factor)
        if not 0.0 < backoff < 1.0:
            raise ConfigError(f"backoff_factor must be in the open range (0, 1), got {backoff}.")
        setattr_(self, "init_scale", init)
        setattr_(self, "growth_factor", growth)
        setattr_(self, "backoff_factor", backoff)
        setattr_(self, "growth_interval", _integer("growth_interval", self.growth_interval, 1))
        setattr_(self, "hysteresis", _integer("hysteresis", self.hysteresis, 1))
        if self.max_consecutive_skips is not None:
            _integer("max_consecutive_skips", self.max_consecutive_skips, 1)
        self._check_bounds()

    def _check_bounds(self) -> None:
        low, high = self.min_scale, self.max_scale
        if low is not None:
            low = _number("min_scale", low)
            if low < FP32_TINY:
                raise ConfigError(
                    f"min_scale must be >= {FP32_TINY:g} (the smallest normal float32), got {low}."
                )
            object.__setattr__(self, "min_scale", low)
        if high is not None:
            high = _number("max_scale", high)
            if not FP32_TINY <= high <= FP32_MAX:
                raise ConfigError(f"max_scale must be a finite float32 > 0, got {high}.")
            object.__setattr__(self, "max_scale", high)
        if low is not None and high is not None and low > high:
            raise ConfigError(f"min_scale ({low}) must not exceed max_scale ({high}).")
        if not (low or 0.0) <= self.init_scale <= (high or FP32_MAX):
            raise ConfigError(
                f"init_scale ({self.init_scale}) must lie within [min_scale, max_scale] "
                f"= [{low}, {high}]."
            )

    @property
    def floor(self) -> float:
        """The smallest scale the rule allows."""
        return FP32_TINY if self.min_scale is None else self.min_scale

    @property
    def is_torch_rule(self) -> bool:
        """True when the update is exactly torch's ``_amp_update_scale_`` (plus the floor)."""
        return self.hysteresis == 1 and self.max_scale is None

    def with_(self, **changes: Any) -> ScalerConfig:
        """A validated copy with ``changes`` applied (the original is untouched)."""
        return replace(self, **changes)
