"""One exception hierarchy for mixprec.

Every error mixprec raises is a :class:`MixprecError` and also a builtin exception, so code written
for ``torch.amp`` that catches ``ValueError`` or ``RuntimeError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "LowPrecisionGradError",
    "MissingGradError",
    "MixprecError",
    "MixprecWarning",
    "NonFiniteError",
    "NonFiniteNormError",
    "OverflowRiskWarning",
    "RegionStateError",
    "ScaleCollapseError",
    "ScaleCollapseWarning",
    "ScalerStateError",
    "UnsupportedDeviceError",
]


class MixprecError(Exception):
    """Base class of every error raised by mixprec."""


class ConfigError(MixprecError, ValueError):
    """A setting or argument has a value outside its allowed range or of the wrong type."""


class ScalerStateError(MixprecError, RuntimeError):
    """A scaler method was called in an order the iteration protocol does not allow."""


class MissingGradError(ScalerStateError):
    """An optimizer was stepped or an update was requested, but no gradient was checked."""


class LowPrecisionGradError(MixprecError, ValueError):
    """Trainable parameters hold fp16 gradients, which cannot be unscaled safely."""


class ScaleCollapseError(MixprecError, RuntimeError):
    """Too many consecutive iterations overflowed: training is no longer making progress."""


class NonFiniteNormError(MixprecError, RuntimeError):
    """``clip_grad_norm_(..., error_if_nonfinite=True)`` met an inf/NaN gradient norm."""


class UnsupportedDeviceError(ConfigError, RuntimeError):
    """A device type this torch build cannot serve (for autocast: no native autocast for it).

    Also a ``RuntimeError``, as torch raises for an unsupported autocast device.
    """


class RegionStateError(MixprecError, RuntimeError):
    """An autocast region was exited without a matching enter (or exited twice)."""


class NonFiniteError(MixprecError, FloatingPointError):
    """Raised at the first non-finite value when ``find_nonfinite(..., raise_on_first=True)``."""


class MixprecWarning(UserWarning):
    """Base class of every warning emitted by mixprec."""


class ScaleCollapseWarning(MixprecWarning):
    """The loss scale fell below 1, or many consecutive steps were skipped."""


class OverflowRiskWarning(MixprecWarning):
    """An fp16 activation came within ``warn_within`` of fp16's largest value (65504)."""
