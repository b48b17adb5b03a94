"""The constructor's two call forms: torch 2's ``GradScaler(device, init_scale, ...)`` and the
torch.cuda.amp 1.5's ``GradScaler(init_scale, growth_factor, ...)`` (no device)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from mixprec.errors import ConfigError


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


def _seed_form(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
    *,
    device: str | torch.device | None = None,
    min_scale: float | None = None,
    max_scale: float | None = None,
    hysteresis: int = 1,
    max_consecutive_skips: int | None = None,
    history: int = 0,
    process_group: Any = None,
) -> None:
    """Signature only."""


SIGNATURE = inspect.signature(_torch_form)
_SEED_SIGNATURE = inspect.signature(_seed_form)


def bind_constructor_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every constructor argument by name, whichever form was used.

    A number as the first positional argument selects torch.cuda.amp's form.

    Raises:
        TypeError: unknown or repeated arguments (as Python would).
    """
    first_is_number = (
        bool(args) and isinstance(args[0], (int, float)) and not isinstance(args[0], bool)
    )
    signature = _SEED_SIGNATURE if first_is_number else SIGNATURE
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def parse_device(device: str | torch.device | None) -> torch.device | None:
    """``None`` or a valid ``torch.device``.

    Raises:
        ConfigError: not a device.
    """
    if device is None or isinstance(device, torch.device):
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
