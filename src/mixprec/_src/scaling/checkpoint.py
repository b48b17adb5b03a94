"""State dicts: validation and conversion, shared by ``load_state_dict`` and ``state_dict``.

A state dict has torch's five keys with torch's meaning (so checkpoints move both ways between
``torch.amp.GradScaler`` and mixprec) plus mixprec's own, which torch ignores when loading.
Everything is validated, against the ranges the state tensors can hold (float32 scale, int32
tracker and streak, int64 counters), before anything changes: a dict that passes can always be
written into the tensors, now or at the first ``scale()``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from mixprec._src.scaling.config import (
    FP32_MAX,
    INT32_MAX,
    INT64_MAX,
    ScalerConfig,
    show,
    to_f32,
)
from mixprec._src.scaling.rule import Values
from mixprec.errors import ConfigError

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _plain(key: str, value: Any) -> Any:
    """A one-element tensor as its Python number; anything else unchanged."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() != 1:
        raise ConfigError(f"state_dict[{key!r}] must hold one number, got shape {value.shape}.")
    if value.is_meta or value.is_complex():
        raise ConfigError(
            f"state_dict[{key!r}] must be a real number, got a tensor of dtype {value.dtype} on "
            f"{value.device}."
        )
    return value.item()


def _scalar(key: str, value: Any) -> float:
    value = _plain(key, value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(
            f"state_dict[{key!r}] must be a number, got {show(value)} ({type(value).__name__})."
        )
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _count(key: str, value: Any, maximum: int) -> int:
    """An int in ``[0, maximum]``; exact for big ints (no trip through float)."""
    value = _plain(key, value)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        number = _scalar(key, value)
        if not number.is_integer():
            raise ConfigError(f"state_dict[{key!r}] must be an int >= 0, got {show(value)}.")
        value = int(number)
    if value < 0:
        raise ConfigError(f"state_dict[{key!r}] must be an int >= 0, got {show(value)}.")
    if value > maximum:
        raise ConfigError(
            f"state_dict[{key!r}] must be an int <= {maximum} (the most the scaler's state "
            f"tensor holds), got {show(value)}."
        )
    return int(value)


def parse_state_dict(
    state_dict: Any, current: ScalerConfig
) -> tuple[ScalerConfig, Values, str | None]:
    """Validate ``state_dict`` completely and return what loading it would set, and a note to
    warn with when the scale had to be brought inside the scaler's bounds.

    Raises:
        ConfigError: not a mapping, a missing torch key, or a value of the wrong type or range.
            Nothing has been changed when it raises.
    """
    _check_keys(state_dict)
    scale = _scalar("scale", state_dict["scale"])
    if not (math.isfinite(scale) and 0 < scale <= FP32_MAX):
        raise ConfigError(f"state_dict['scale'] must be finite and > 0, got {show(scale)}.")
    config = _config_from(state_dict, current)
    rounded = to_f32(scale)
    scale = min(max(rounded, config.floor), config.ceiling)
    note = None
    if scale != rounded:
        note = (
            f"state_dict['scale'] = {show(rounded)} is outside this scaler's bounds "
            f"[{config.floor:g}, {config.ceiling:g}] (min_scale/max_scale, or the smallest "
            f"normal float32); loaded as {scale:g}."
        )
    counters = state_dict.get("_counters", [0, 0, 0, 0])
    if not isinstance(counters, (list, tuple)) or len(counters) != 4:
        raise ConfigError(
            f"state_dict['_counters'] must be a list of 4 ints, got {show(counters)}."
        )
    tracker = _count("_growth_tracker", state_dict["_growth_tracker"], INT32_MAX)
    values = Values(
        scale=scale,
        # Capped like set_growth_interval does: at or past the interval, torch's kernel
        # (``tracker + 1 == interval``) would never grow again; this grows at the next clean one.
        growth_tracker=min(tracker, config.growth_interval - 1),
        overflow_streak=_count(
            "_overflow_streak", state_dict.get("_overflow_streak", 0), INT32_MAX
        ),
        counters=tuple(_count("_counters", c, INT64_MAX) for c in counters),  # type: ignore[arg-type]
    )
    return config, values, note


def _check_keys(state_dict: Any) -> None:
    if not isinstance(state_dict, Mapping):
        raise ConfigError(
            f"load_state_dict expects a dict from GradScaler.state_dict(), got "
            f"{type(state_dict).__name__}."
        )
    if not state_dict:
        raise ConfigError(
            "The source state dict is empty, possibly because it was saved from a disabled "
            "GradScaler (enabled=False). Load a state dict saved from an enabled scaler, or "
            "start from the constructor's settings."
        )
    missing = [key for key in TORCH_KEYS if key not in state_dict]
    if missing:
        raise ConfigError(
            f"The state dict lacks {missing}; it has {sorted(state_dict)}. Pass the dict "
            "returned by GradScaler.state_dict() (torch's or mixprec's)."
        )


def _config_from(state_dict: Mapping[str, Any], current: ScalerConfig) -> ScalerConfig:
    def optional(key: str, default: float | None) -> float | None:
        value = _plain(key, state_dict.get(key, default))
        return None if value is None else _scalar(key, value)

    def whole(key: str, value: Any) -> Any:
        value = _plain(key, value)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        number = _scalar(key, value)
        if not number.is_integer():
            raise ConfigError(f"state_dict[{key!r}] must be an int, got {show(value)}.")
        return int(number)

    low = optional("min_scale", current.min_scale)
    high = optional("max_scale", current.max_scale)
    return ScalerConfig(
        init_scale=min(max(current.init_scale, low or 0.0), high or FP32_MAX),
        growth_factor=_scalar("growth_factor", state_dict["growth_factor"]),
        backoff_factor=_scalar("backoff_factor", state_dict["backoff_factor"]),
        growth_interval=whole("growth_interval", state_dict["growth_interval"]),
        min_scale=low,
        max_scale=high,
        hysteresis=whole("hysteresis", state_dict.get("hysteresis", current.hysteresis)),
        max_consecutive_skips=current.max_consecutive_skips,
    )


def export_state(config: ScalerConfig, values: Values) -> dict[str, Any]:
    """The state dict for ``config`` and the tensors' current ``values``."""
    return {
        "scale": values.scale,
        "growth_factor": config.growth_factor,
        "backoff_factor": config.backoff_factor,
        "growth_interval": config.growth_interval,
        "_growth_tracker": values.growth_tracker,
        "min_scale": config.min_scale,
        "max_scale": config.max_scale,
        "hysteresis": config.hysteresis,
        "_overflow_streak": values.overflow_streak,
        "_counters": list(values.counters),
    }
