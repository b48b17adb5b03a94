"""State dicts: torch's five keys with torch's meaning (checkpoints move both ways) plus mixprec's
own, which torch ignores. Loading validates everything against what the state can hold before
anything changes."""

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


def _int(key: str, value: Any, maximum: int | None = None) -> int:
    """An int (or a whole float; exact for big ints), in ``[0, maximum]`` if ``maximum``."""
    value, kind = _plain(key, value), "an int" if maximum is None else "an int >= 0"
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        number = _scalar(key, value)
        if not number.is_integer():
            raise ConfigError(f"state_dict[{key!r}] must be {kind}, got {show(value)}.")
        value = number
    value = int(value)
    if maximum is not None and not 0 <= value <= maximum:
        kind = kind if value < 0 else f"an int <= {maximum} (the most the scaler's state holds)"
        raise ConfigError(f"state_dict[{key!r}] must be {kind}, got {show(value)}.")
    return value


def parse_state_dict(
    state_dict: Any, current: ScalerConfig
) -> tuple[ScalerConfig, Values, str | None]:
    """What loading ``state_dict`` would set, and a warning when the scale had to be brought
    inside the scaler's bounds (ConfigError for anything it cannot load)."""
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
    tracker = _int("_growth_tracker", state_dict["_growth_tracker"], INT32_MAX)
    streak = _int("_overflow_streak", state_dict.get("_overflow_streak", 0), INT32_MAX)
    counts = tuple(_int("_counters", c, INT64_MAX) for c in counters)
    # The tracker capped as set_growth_interval caps it: at or past the interval, torch's kernel
    # (``tracker + 1 == interval``) would never grow again.
    tracker = min(tracker, config.growth_interval - 1)
    return config, Values(scale, tracker, streak, counts), note  # type: ignore[arg-type]


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

    low = optional("min_scale", current.min_scale)
    high = optional("max_scale", current.max_scale)
    return ScalerConfig(
        init_scale=min(max(current.init_scale, low or 0.0), high or FP32_MAX),
        growth_factor=_scalar("growth_factor", state_dict["growth_factor"]),
        backoff_factor=_scalar("backoff_factor", state_dict["backoff_factor"]),
        growth_interval=_int("growth_interval", state_dict["growth_interval"]),
        min_scale=low,
        max_scale=high,
        hysteresis=_int("hysteresis", state_dict.get("hysteresis", current.hysteresis)),
        max_consecutive_skips=current.max_consecutive_skips,
    )


def export_state(config: ScalerConfig, values: Values) -> dict[str, Any]:
    """The state dict of ``config`` and ``values``."""
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
