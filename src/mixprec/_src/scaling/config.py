"""Frozen, validated scaler settings and the constructor's two call forms.

Every bad value raises :class:`~mixprec.errors.ConfigError` naming the setting, the value and the
allowed range. The scale and its bounds are rounded to float32 here, as torch rounds a Python float
written into a float32 tensor, so that the host and the device never disagree.
"""

from __future__ import annotations

import inspect
import math
import numbers
import struct
from dataclasses import dataclass, replace
from typing import Any

import torch

from mixprec.errors import ConfigError

FP32_TINY = 2.0**-126  # the smallest normal float32: the scale's floor, so 1/scale stays finite
FP32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1  # the tracker and streak tensors
INT64_MAX = 2**63 - 1  # the counters
MAX_HISTORY = 1_000_000  # history entries kept at most
_F32 = struct.Struct("f")


def to_f32(value: float) -> float:
    """Round a Python float to the nearest float32 (inf when it overflows), as ``fill_`` does."""
    try:
        return float(_F32.unpack(_F32.pack(value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


def show(value: Any) -> str:
    """``repr(value)``, shortened for messages (a 400-digit int stays readable)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def real(name: str, value: Any) -> float:
    """``value`` as a finite float (Python and numpy numbers; not bools, strings or tensors)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(
            f"{name} must be a real number, got {show(value)} ({type(value).__name__})."
        )
    try:
        number = float(value)
    except (OverflowError, ValueError):
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{name} must be finite, got {show(value)}.")
    return number


def integer(name: str, value: Any, minimum: int, maximum: int = INT64_MAX) -> int:
    """``value`` as an int in ``[minimum, maximum]`` (Python and numpy ints; not bools)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(
            f"{name} must be an int >= {minimum}, got {show(value)} ({type(value).__name__})."
        )
    number = int(value)
    if number < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {show(value)}.")
    if number > maximum:
        raise ConfigError(f"{name} must be an int <= {maximum}, got {show(value)}.")
    return number


@dataclass(frozen=True)
class ScalerConfig:
    """The settings of a :class:`~mixprec.GradScaler` (its arguments of the same names), checked
    on construction; the scale and its bounds rounded to float32.

    Example:
        >>> ScalerConfig(init_scale=1024.0, growth_interval=100).growth_interval
        100
        >>> ScalerConfig(init_scale=1000.1).init_scale  # the nearest float32
        1000.0999755859375
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
        init = real("init_scale", self.init_scale)
        if not 0 < init <= FP32_MAX:
            raise ConfigError(f"init_scale must be in (0, {FP32_MAX:g}] (a float32), got {init}.")
        if init < FP32_TINY:
            raise ConfigError(
                f"init_scale must be at least {FP32_TINY:g}, the smallest normal float32 "
                f"(1/scale must stay finite), got {init}."
            )
        growth = real("growth_factor", self.growth_factor)
        if growth <= 1.0:
            raise ConfigError(f"growth_factor must be > 1.0, got {growth}.")
        backoff = real("backoff_factor", self.backoff_factor)
        if not 0.0 < backoff < 1.0:
            raise ConfigError(f"backoff_factor must be in the open range (0, 1), got {backoff}.")
        setattr_(self, "init_scale", to_f32(init))
        setattr_(self, "growth_factor", growth)
        setattr_(self, "backoff_factor", backoff)
        setattr_(self, "growth_interval", integer("growth_interval", self.growth_interval, 1))
        setattr_(self, "hysteresis", integer("hysteresis", self.hysteresis, 1, INT32_MAX))
        if self.max_consecutive_skips is not None:
            skips = integer("max_consecutive_skips", self.max_consecutive_skips, 1, INT32_MAX)
            setattr_(self, "max_consecutive_skips", skips)
        self._check_bounds()

    def _check_bounds(self) -> None:
        low, high = self.min_scale, self.max_scale
        if low is not None:
            low = real("min_scale", low)
            if low < FP32_TINY:
                raise ConfigError(
                    f"min_scale must be >= {FP32_TINY:g} (the smallest normal float32), got {low}."
                )
            if low > FP32_MAX:
                raise ConfigError(f"min_scale must be a finite float32, got {low}.")
            object.__setattr__(self, "min_scale", low := to_f32(low))
        if high is not None:
            high = real("max_scale", high)
            if not FP32_TINY <= high <= FP32_MAX:
                raise ConfigError(f"max_scale must be a finite float32 > 0, got {high}.")
            object.__setattr__(self, "max_scale", high := to_f32(high))
        if low is not None and high is not None and low > high:
            raise ConfigError(f"min_scale ({low}) must not exceed max_scale ({high}).")
        if not (low or 0.0) <= self.init_scale <= (high or FP32_MAX):
            raise ConfigError(
                f"init_scale ({self.init_scale}) must lie within [min_scale, max_scale] "
                f"= [{low}, {high}]."
            )

    @property
    def floor(self) -> float:
        return FP32_TINY if self.min_scale is None else self.min_scale

    @property
    def ceiling(self) -> float:
        return FP32_MAX if self.max_scale is None else self.max_scale

    @property
    def is_torch_rule(self) -> bool:
        """True when the update is exactly torch's ``_amp_update_scale_`` (plus the floor): its
        settings, and an interval its int32 tracker can reach."""
        return self.hysteresis == 1 and self.max_scale is None and self.growth_interval <= INT32_MAX


def validated_new_scale(value: Any, device: torch.device, config: ScalerConfig) -> float:
    """``update(new_scale)``'s argument (a number, or a 1-element real tensor on the scale's
    device type) checked against the bounds, as a float32 value. Host sync: one for a tensor (its
    value is checked on every device: a NaN copied in unchecked would skip every later step)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.requires_grad or value.is_complex():
            raise ConfigError(
                "new_scale must be a float or a 1-element tensor (real, requires_grad=False), "
                f"got a {value.dtype} tensor of shape {tuple(value.shape)} "
                f"(requires_grad={value.requires_grad})."
            )
        if value.device.type != device.type:
            raise ConfigError(
                f"new_scale is on {value.device} but the scale lives on {device}; pass "
                f"new_scale.to('{device}') or a float."
            )
        return validated_new_scale(value.item(), device, config)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(
            f"new_scale must be a float, an int, a 1-element tensor or the optimizer, got "
            f"{type(value).__name__}."
        )
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not config.floor <= number <= config.ceiling:
        raise ConfigError(
            f"new_scale must be finite and within [{config.floor:g}, {config.ceiling:g}] (the "
            f"scaler's bounds), got {show(value)}."
        )
    return to_f32(number)


@dataclass(frozen=True)
class Settings:
    """Everything a GradScaler was built with but the process group (neither saved nor pickled);
    ``device`` is the argument's type, for messages (the scale lives where the outputs are)."""

    config: ScalerConfig
    enabled: bool = True
    history: int = 0
    device: str | None = None

    def with_config(self, **changes: Any) -> Settings:
        """A copy with a validated new config (the original is untouched)."""
        return replace(self, config=replace(self.config, **changes))


def _torch_form(
    device: str | torch.device | None = None,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
    *,
    min_scale: float | None = None,
    max_scale: float | None = None,
    hysteresis: int = 1,
    max_consecutive_skips: int | None = None,
    history: int = 0,
    process_group: Any = None,
) -> None:
    """Signature only."""


SIGNATURE = inspect.signature(_torch_form)
# torch.cuda.amp 1.5's form: no device first (it is keyword-only there).
_FIRST, *_REST = SIGNATURE.parameters.values()
_CUDA_AMP_SIGNATURE = SIGNATURE.replace(
    parameters=[*_REST[:5], _FIRST.replace(kind=inspect.Parameter.KEYWORD_ONLY), *_REST[5:]]
)


def settings_from(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Settings, Any]:
    """``(settings, process_group)`` from the constructor's arguments, validated; a number first
    selects torch.cuda.amp's form (TypeError for unknown or repeated arguments, as Python's)."""
    number_first = bool(args) and type(args[0]) is not bool and isinstance(args[0], (int, float))
    bound = (_CUDA_AMP_SIGNATURE if number_first else SIGNATURE).bind(*args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    enabled, device, group = named.pop("enabled"), named.pop("device"), named.pop("process_group")
    if not isinstance(enabled, bool):
        raise ConfigError(f"enabled must be a bool, got {enabled!r}.")
    history = named.pop("history")
    if isinstance(history, bool) or not isinstance(history, int) or history < 0:
        raise ConfigError(f"history must be an int >= 0 (entries kept), got {history!r}.")
    history = integer("history", history, 0, MAX_HISTORY)
    kind = None if device is None else _device(device).type
    return Settings(ScalerConfig(**named), enabled, history, kind), group


def _device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise ConfigError(
            f"device must be a str, a torch.device or None, got {device!r} "
            f"({type(device).__name__})."
        )
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(
            f"device {device!r} is not a torch device ('cpu', 'cuda', 'cuda:1', 'mps', ...)."
        ) from exc
