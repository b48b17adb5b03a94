"""Casting helpers shared by module rules, op rules and custom_fwd (one level deep, no pytree)."""

from __future__ import annotations

from typing import Any

import torch


def eligible(t: object, device_type: str) -> bool:
    """Whether native autocast would cast ``t``: a floating, non-float64 tensor on the device.

    Example:
        >>> import torch
        >>> eligible(torch.ones(1), "cpu"), eligible(torch.ones(1, dtype=torch.float64), "cpu")
        (True, False)

    Host sync: none.
    """
    return (
        isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.dtype != torch.float64
        and t.device.type == device_type
    )


def cast_value(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    """Cast an eligible tensor, or the eligible tensors of a list/tuple, to ``dtype``.

    Example:
        >>> import torch
        >>> cast_value([torch.ones(1), 3], "cpu", torch.bfloat16)[0].dtype
        torch.bfloat16

    Host sync: none.
    """
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if eligible(value, device_type) else value
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        cast = [v.to(dtype) if eligible(v, device_type) else v for v in value]
        return cast if isinstance(value, list) else type(value)(cast)
    return value


def cast_tree(
    args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str, dtype: torch.dtype
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Cast eligible tensors among ``args`` and ``kwargs`` (and one nested list level).

    Example:
        >>> import torch
        >>> a, k = cast_tree((torch.ones(1),), {"w": torch.ones(1)}, "cpu", torch.float16)
        >>> a[0].dtype, k["w"].dtype
        (torch.float16, torch.float16)

    Host sync: none.
    """
    new_args = tuple(cast_value(a, device_type, dtype) for a in args)
    new_kwargs = {k: cast_value(v, device_type, dtype) for k, v in kwargs.items()}
    return new_args, new_kwargs


def _tensors(values: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def first_floating_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The dtype of the first floating tensor among the arguments (None if there is none).

    Example:
        >>> import torch
        >>> first_floating_dtype((1, torch.ones(1, dtype=torch.bfloat16)), {})
        torch.bfloat16

    Host sync: none.
    """
    for t in _tensors((*args, *kwargs.values())):
        if t.is_floating_point():
            return t.dtype
    return None


def promote_dtype(
    args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str
) -> torch.dtype | None:
    """The widest eligible input dtype: fp32 if any input is fp32 or low dtypes are mixed.

    Example:
        >>> import torch
        >>> promote_dtype((torch.ones(1, dtype=torch.float16), torch.ones(1)), {}, "cpu")
        torch.float32

    Host sync: none.
    """
    found = {t.dtype for t in _tensors((*args, *kwargs.values())) if eligible(t, device_type)}
    if not found:
        return None
    if len(found) == 1:
        return next(iter(found))
    return torch.float32


def run_without_autocast(device_type: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with native autocast off for ``device_type`` (restored afterwards).

    Example:
        >>> import torch
        >>> run_without_autocast("cpu", torch.is_autocast_enabled, "cpu")
        False

    Host sync: none.
    """
    prev = torch.is_autocast_enabled(device_type)
    torch.set_autocast_enabled(device_type, False)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_autocast_enabled(device_type, prev)
