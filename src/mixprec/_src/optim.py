"""Facts about a torch optimizer that several parts of mixprec need.

* how ``step`` was given a closure, and how to hand it a replacement (:class:`ClosureCall`);
* how a fused optimizer is handed ``grad_scale``/``found_inf`` (:func:`fused_step`), and whether
  ``step`` takes ``grad_scaler=`` instead (torch's legacy fused contract, :func:`legacy_step`);
* whether a fused optimizer's state exists yet, so that a skipped first step cannot leave it
  half-created (:func:`needs_first_step_read`), remembered on the optimizer so that an iteration
  needs no host read once it does;
* which :class:`~mixprec.MasterWeights` converted it (:func:`masters_of`), so that the closure code
  and the master weights meet here without importing each other.

Nothing here knows about the scaler.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_Optimizer = torch.optim.Optimizer
# inspect.signature is slow next to a step's other work, and a step function's parameters never
# change.
_TAKES_GRAD_SCALER: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
# Set on an optimizer after a fused step that ran: the shape of its state then.
_SEEN = "_mixprec_state_seen"
#: The attribute of an optimizer converted by MasterWeights that holds the converter.
MASTERS = "_mixprec_master_weights"


@dataclass(frozen=True)
class ClosureCall:
    """The closure given to ``step`` and how to pass its replacement to the optimizer."""

    closure: Callable[[], Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    keyword: bool

    def invoke(self, optimizer: _Optimizer, wrapped: Callable[[], Any]) -> Any:
        """``optimizer.step`` with ``wrapped`` where the user's closure was.

        Host sync: whatever the optimizer and the closure do.
        """
        return self.invoke_with(optimizer.step, wrapped)

    def invoke_with(self, step: Callable[..., Any], wrapped: Callable[[], Any]) -> Any:
        """``step(...)`` with ``wrapped`` where the user's closure was.

        Host sync: whatever ``step`` and the closure do.
        """
        if self.keyword:
            return step(*self.args, closure=wrapped, **self.kwargs)
        return step(wrapped, *self.args, **self.kwargs)


def split_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> ClosureCall | None:
    """The closure passed to ``step`` (``closure=`` or first positional), or None.

    Host sync: none.
    """
    if kwargs.get("closure") is not None:
        rest = {k: v for k, v in kwargs.items() if k != "closure"}
        return ClosureCall(kwargs["closure"], args, rest, keyword=True)
    if args and callable(args[0]):
        return ClosureCall(args[0], args[1:], kwargs, keyword=False)
    return None


def takes_grad_scaler(optimizer: _Optimizer) -> bool:
    """Whether ``optimizer.step`` has a ``grad_scaler`` parameter (torch's legacy fused contract).

    Cached per underlying function, so wrappers that patch ``step`` on an instance (accelerate,
    LR schedulers) are looked at once each.

    Host sync: none.
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


def fused_step(
    optimizer: _Optimizer, grad_scale: Any, found_inf: torch.Tensor, args: tuple, kwargs: dict
) -> Any:
    """``optimizer.step(*args, **kwargs)`` with ``grad_scale``/``found_inf`` set on it for the
    step (torch's contract for ``_step_supports_amp_scaling`` optimizers), then remembered as a
    real step (:func:`needs_first_step_read`).

    Host sync: whatever the optimizer does.
    """
    optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf  # type: ignore[attr-defined]
    try:
        result = optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
    shape = _state_shape(optimizer)
    if getattr(optimizer, _SEEN, None) != shape:
        setattr(optimizer, _SEEN, shape)
    return result


def legacy_step(optimizer: _Optimizer, scaler: Any, args: tuple, kwargs: dict) -> Any:
    """``optimizer.step(..., grad_scaler=scaler)``, torch's legacy fused contract (the optimizer
    calls ``scaler._check_inf_per_device(self)`` and unscales itself), with torch's warning.

    Host sync: whatever the optimizer does.
    """
    warnings.warn(
        "GradScaler is going to stop passing itself as a keyword argument to the passed "
        "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
        "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
        FutureWarning,
        stacklevel=3,
    )
    return optimizer.step(*args, **{**kwargs, "grad_scaler": scaler})


def _state_shape(optimizer: _Optimizer) -> tuple[int, ...]:
    """Parameters per group and the number of state entries: changes when either does."""
    return (*(len(group["params"]) for group in optimizer.param_groups), len(optimizer.state))


def needs_first_step_read(optimizer: _Optimizer) -> bool:
    """Whether a fused step must read the overflow flag on the host before stepping.

    True while some parameter with a grad has no optimizer state and the optimizer has not yet
    taken a real step with its current parameters and state: a skipped step there could leave
    state half-created (torch's fused SGD keeps an uninitialised momentum buffer). Optimizers
    whose state stays empty (fused SGD without momentum) therefore read only once.

    Host sync: none.
    """
    if getattr(optimizer, _SEEN, None) == _state_shape(optimizer):
        return False
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and not optimizer.state.get(param):
                return True
    return False


def masters_of(optimizer: Any) -> Any:
    """The :class:`~mixprec.MasterWeights` that converted ``optimizer``, or None.

    Host sync: none.
    """
    return getattr(optimizer, MASTERS, None)
