"""Checks on arguments and optimizers that the GradScaler shell runs before acting."""

from __future__ import annotations

import inspect
import numbers
import weakref
from typing import Any

import torch

from mixprec._src.scaling.config import FP32_MAX, ScalerConfig
from mixprec.errors import ConfigError

# inspect.signature costs tens of microseconds; a step function's parameters never change.
_TAKES_GRAD_SCALER: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def takes_grad_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` has a ``grad_scaler`` parameter (torch's legacy fused contract).

    Cached per underlying function, so wrappers that patch ``step`` on an instance (accelerate,
    LR schedulers) are looked at once each.
    """
    step = optimizer.step
    key = getattr(step, "__func__", step)
    try:
        known = _TAKES_GRAD_SCALER.get(key)
    except TypeError:  # not weak-referenceable: look every time
        return "grad_scaler" in inspect.signature(step).parameters
    if known is None:
        known = _TAKES_GRAD_SCALER[key] = "grad_scaler" in inspect.signature(step).parameters
    return known


def has_uninitialised_state(optimizer: torch.optim.Optimizer) -> bool:
    """True when some parameter with a grad has no optimizer state yet (its first step)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and not optimizer.state.get(param):
                return True
    return False


def validated_new_scale(
    value: Any, device: torch.device, config: ScalerConfig
) -> float | torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.requires_grad:
            raise ConfigError(
                "new_scale must be a float or a 1-element tensor with requires_grad=False, got a "
                f"tensor of shape {tuple(value.shape)} (requires_grad={value.requires_grad})."
            )
        if value.device.type != device.type:
            raise ConfigError(
                f"new_scale is on {value.device} but the scale lives on {device}; pass "
                f"new_scale.to('{device}') or a float."
            )
        if value.is_cpu:
            validated_new_scale(float(value.item()), device, config)
        return value.reshape(())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(
            f"new_scale must be a float, an int, a 1-element tensor or the optimizer, got "
            f"{type(value).__name__}."
        )
    low, high = config.floor, config.max_scale or FP32_MAX
    if not low <= float(value) <= high:
        raise ConfigError(
            f"new_scale must be finite and within [{low:g}, {high:g}] (the scaler's bounds), "
            f"got {value}."
        )
    return float(value)
