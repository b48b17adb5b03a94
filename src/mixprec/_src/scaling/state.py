"""State-dict validation and conversion, shared by load_state_dict and pickling.

A state dict has torch's five keys with torch's meaning (so checkpoints move both ways between
``torch.amp.GradScaler`` and mixprec) plus mixprec's own, which torch ignores when loading.
Everything is validated before anything changes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mixprec._src.scaling.config import FP32_MAX, ScalerConfig
from mixprec.errors import ConfigError

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


@dataclass(frozen=True)
class LoadedState:
    """A validated state dict: the new settings and the values to put in the tensors."""

    config: ScalerConfig
    scale: float
    growth_tracker: int
    overflow_streak: int
    counters: list[int]


def _scalar(key: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(f"state_dict[{key!r}] must hold one number, got shape {value.shape}.")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(
            f"state_dict[{key!r}] must be a number, got {value!r} ({type(value).__name__})."
        )
    return float(value)


def _count(key: str, value: Any) -> int:
    number = _scalar(key, value)
    if not number.is_integer() or number < 0:
        raise ConfigError(f"state_dict[{key!r}] must be an int >= 0, got {value!r}.")
    return int(number)


def parse_state_dict(state_dict: Any, current: ScalerConfig) -> LoadedState:
    """Validate ``state_dict`` completely and return what loading it would set.

    Raises:
        ConfigError: not a mapping, a missing torch key, or a value of the wrong type or range.
            Nothing has been changed when it raises.
    """
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
    scale = _scalar("scale", state_dict["scale"])
    if not (math.isfinite(scale) and 0 < scale <= FP32_MAX):
        raise ConfigError(f"state_dict['scale'] must be finite and > 0, got {scale}.")
    config = _config_from(state_dict, current)
    scale = min(max(scale, config.floor), config.max_scale or FP32_MAX)
    counters = state_dict.get("_counters", [0, 0, 0, 0])
    if not isinstance(counters, (list, tuple)) or len(counters) != 4:
        raise ConfigError(f"state_dict['_counters'] must be a list of 4 ints, got {counters!r}.")
    return LoadedState(
        config=config,
        scale=scale,
        # Capped like set_growth_interval does: at or past the interval, torch's kernel
        # (``tracker + 1 == interval``) would never grow again; this grows at the next clean one.
        growth_tracker=min(
            _count("_growth_tracker", state_dict["_growth_tracker"]), config.growth_interval - 1
        ),
        overflow_streak=_count("_overflow_streak", state_dict.get("_overflow_streak", 0)),
        counters=[_count("_counters", c) for c in counters],
    )


def _config_from(state_dict: Mapping[str, Any], current: ScalerConfig) -> ScalerConfig:
    def optional(key: str, default: float | None) -> float | None:
        value = state_dict.get(key, default)
        return None if value is None else _scalar(key, value)

    interval = _scalar("growth_interval", state_dict["growth_interval"])
    if not interval.is_integer():
        raise ConfigError(f"state_dict['growth_interval'] must be an int, got {interval}.")
    hysteresis = _scalar("hysteresis", state_dict.get("hysteresis", current.hysteresis))
    if not hysteresis.is_integer():
        raise ConfigError(f"state_dict['hysteresis'] must be an int, got {hysteresis}.")
    low = optional("min_scale", current.min_scale)
    high = optional("max_scale", current.max_scale)
    return ScalerConfig(
        init_scale=min(max(current.init_scale, low or 0.0), high or FP32_MAX),
        growth_factor=_scalar("growth_factor", state_dict["growth_factor"]),
        backoff_factor=_scalar("backoff_factor", state_dict["backoff_factor"]),
        growth_interval=int(interval),
        min_scale=low,
        max_scale=high,
        hysteresis=int(hysteresis),
        max_consecutive_skips=current.max_consecutive_skips,
    )


def export_state(config: ScalerConfig, values: LoadedState) -> dict[str, Any]:
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
