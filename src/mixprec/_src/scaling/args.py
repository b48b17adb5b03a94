"""The constructor's two call forms and the frozen settings they produce.

torch 2's ``GradScaler(device, init_scale, ...)`` and torch.cuda.amp 1.5's
``GradScaler(init_scale, growth_factor, ...)`` (no device) bind to the same names; the values are
validated into a :class:`Settings` before the scaler exists.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from mixprec._src.scaling.config import ScalerConfig, integer
from mixprec.errors import ConfigError

#: The most history entries kept (two tensors of this many elements on the scale's device).
MAX_HISTORY = 1_000_000


@dataclass(frozen=True)
class Settings:
    """Everything a GradScaler was built with, except the process group (not a setting: it is
    neither saved nor pickled).

    Attributes:
        config: the update rule's settings.
        enabled: ``False`` makes every method a pass-through.
        history: iterations of scale history kept, ``0 <= history <= MAX_HISTORY``.
        device: the ``device`` argument's type, for messages (the scale lives where the outputs
            are).
    """

    config: ScalerConfig
    enabled: bool = True
    history: int = 0
    device: str | None = None

    def with_config(self, **changes: Any) -> Settings:
        """A copy with a validated new config (the original is untouched). Host sync: none."""
        return dataclasses.replace(self, config=self.config.with_(**changes))


def settings_from(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Settings, Any]:
    """``(settings, process_group)`` from the constructor's arguments, validated.

    Raises:
        TypeError: unknown or repeated arguments (as Python would).
        ConfigError: a value of the wrong type or out of range.
    """
    bound = bind_constructor_args(args, kwargs)
    enabled = bound.pop("enabled")
    if not isinstance(enabled, bool):
        raise ConfigError(f"enabled must be a bool, got {enabled!r}.")
    device = parse_device(bound.pop("device"))
    group = bound.pop("process_group")
    history = bound.pop("history")
    if isinstance(history, bool) or not isinstance(history, int) or history < 0:
        raise ConfigError(f"history must be an int >= 0 (entries kept), got {history!r}.")
    history = integer("history", history, 0, MAX_HISTORY)
    config = ScalerConfig(**bound)
    kind = None if device is None else device.type
    return Settings(config=config, enabled=enabled, history=history, device=kind), group


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
