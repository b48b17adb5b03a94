"""The advisor's arguments, checked before its first pass: each bad value is a ConfigError that
names it and the fix, and nothing has run yet."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec._src.advisor.choose.search import OBJECTIVES
from mixprec._src.torch_compat import compiled_original
from mixprec.errors import ConfigError

LOSS_FORM = (
    "the advisor calls it as loss_fn(model, batch): it runs the model on the batch and returns "
    "the loss, e.g. lambda model, batch: F.mse_loss(model(batch[0]), batch[1])"
)


def check_args(
    model: object,
    loss_fn: object,
    numbers: tuple[object, object],
    flags: tuple[object, object, object],
    objective: object,
) -> None:
    """``numbers``: (min_sqnr, keep_at_most); ``flags``: (check, more_batches, progress)."""
    check_model(model)
    if not callable(loss_fn):
        raise ConfigError(f"loss_fn must be callable; {LOSS_FORM}; got {type(loss_fn).__name__}")
    _check_numbers(*numbers)
    check, more_batches, progress = flags
    if not isinstance(check, bool):
        raise ConfigError(f"check must be True or False, got {check!r}")
    if not isinstance(more_batches, (list, tuple)):
        raise ConfigError(
            f"more_batches must be a list or tuple of further batches, got "
            f"{type(more_batches).__name__} {_short(more_batches)}"
        )
    if progress is not None and not callable(progress):
        raise ConfigError(
            "progress must be None or a function called as progress(done, total, label), got "
            f"{type(progress).__name__} {_short(progress)}"
        )
    if objective not in OBJECTIVES:
        raise ConfigError(
            f"objective must be one of {', '.join(map(repr, OBJECTIVES))}, got {objective!r}"
        )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_numbers(min_sqnr: object, keep_at_most: object) -> None:
    if min_sqnr is not None and (
        isinstance(min_sqnr, bool)
        or not isinstance(min_sqnr, (int, float))
        or not math.isfinite(min_sqnr)
    ):
        raise ConfigError(f"min_sqnr must be a finite number of dB or None, got {min_sqnr!r}")
    if keep_at_most is not None and (
        isinstance(keep_at_most, bool) or not isinstance(keep_at_most, int) or keep_at_most < 0
    ):
        raise ConfigError(f"keep_at_most must be an int >= 0 or None, got {keep_at_most!r}")


def check_float32(model: nn.Module) -> None:
    """The reference is the model's own float32 run: 16-bit parameters or buffers cannot give
    one."""
    named = [*model.named_parameters(), *model.named_buffers()]
    low = [(n, t.dtype) for n, t in named if t.is_floating_point() and t.element_size() < 4]
    if low:
        name, dtype = low[0]
        raise ConfigError(
            f"the model has {len(low)} {str(dtype).removeprefix('torch.')} parameters or "
            f"buffers (first: {name!r}); the advisor compares low precision with the model's "
            "float32 run, so it needs float32 parameters: advise a float32 copy "
            "(copy.deepcopy(model).float(), with float32 inputs) and train with the proposed "
            "policy under mixprec.autocast, which keeps float32 master weights"
        )


def check_loss_signature(loss_fn: Callable[..., Any], model: nn.Module, batch: Any) -> None:
    """A loss function that cannot take two positional arguments is refused up front."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin without a signature: the first call tells
        return
    try:
        signature.bind(model, batch)
    except TypeError as exc:
        raise ConfigError(
            f"loss_fn{signature} cannot be called with (model, batch) ({exc}); {LOSS_FORM}"
        ) from None


def device_of(model: nn.Module) -> torch.device:
    """Where the model's first parameter or buffer lives (the CPU for an empty model)."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def check_model(model: object) -> None:
    """A module the advisor can hook: not a ``torch.compile``'d one (its graph would replay
    the hooks of its first call).

    Raises:
        ConfigError: not a module, or a compiled one (the message says what to pass).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    compiled = next((n for n, m in model.named_modules() if compiled_original(m) is not None), None)
    if compiled is not None:
        what = "model is" if not compiled else f"model.{compiled} is"
        raise ConfigError(
            f"{what} a torch.compile'd module; the advisor measures the eager model, module by "
            "module, through forward hooks a compiled graph does not run: pass the module you "
            "compiled (its ._orig_mod, the same parameters) and train the compiled one with "
            "the proposed policy"
        )
