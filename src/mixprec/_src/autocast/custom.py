"""``custom_fwd`` / ``custom_bwd`` for custom ``autograd.Function``s, device inferred.

Works with both styles of Function: ``forward(ctx, ...)`` and ``forward(...)`` plus
``setup_context(ctx, inputs, output)`` (torch's decorators fail on the latter, pytorch#132388). For
the ``setup_context`` style the forward's autocast state is bound to the output's ``grad_fn``
(which is the ``ctx`` that ``backward`` receives) the next time mixprec looks: at the exit of the
region, or at the next ``custom_fwd``/``custom_bwd`` call outside regions; until then mixprec holds
a reference to the outputs of calls whose inputs require grad.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.autograd.function import FunctionCtx

from mixprec._src.autocast.casting import cast_tree, run_without_autocast
from mixprec._src.autocast.native import default_device_type, resolve_device_type
from mixprec._src.torch_compat import pytree_leaves, torch_custom_fwd_state
from mixprec.errors import ConfigError

_ATTR = "_mixprec_fwd_state"


class _FwdState(NamedTuple):
    device_type: str
    enabled: bool
    dtype: torch.dtype


class _Calls:
    """One thread's recorded ``setup_context``-style calls."""

    __slots__ = ("items", "thread")

    def __init__(self) -> None:
        self.items: list[tuple[list[torch.Tensor], _FwdState]] = []
        self.thread = weakref.ref(threading.current_thread())

    def alive(self) -> bool:
        thread = self.thread()
        return thread is not None and thread.is_alive()


class _Pending(threading.local):
    def __init__(self) -> None:
        self.calls = _Calls()
        with _LOCK:
            _ALL.append(self.calls)


# The calls of each thread stay that thread's while it runs (another thread's may not have their
# grad_fn yet): each thread binds its own and those of threads that ended; a backward in another
# thread (CUDA's device threads) looks for its ctx in every thread's calls.
_LOCK = threading.Lock()
_ALL: list[_Calls] = []
PENDING = _Pending()
_BOUND: weakref.WeakKeyDictionary[Any, _FwdState] = weakref.WeakKeyDictionary()


def has_pending() -> bool:
    """Whether this thread recorded calls not bound yet. Host sync: none."""
    return bool(PENDING.calls.items)


def bind_pending() -> None:
    """Bind the forward state of this thread's ``setup_context``-style calls (and those of
    threads that ended) to their outputs' ``grad_fn`` and drop the outputs (at the next
    custom_fwd/custom_bwd call, and when a region exits).

    Example:
        >>> bind_pending(); has_pending()
        False

    Host sync: none.
    """
    own = PENDING.calls
    if not own.items and len(_ALL) == 1:
        return
    with _LOCK:
        ended = [c for c in _ALL if c is not own and not c.alive()]
        _ALL[:] = [c for c in _ALL if c is own or c.alive()]
        calls = [call for c in (own, *ended) for call in c.items]
        own.items.clear()
    for outputs, state in calls:
        for t in outputs:
            if t.grad_fn is not None:
                _BOUND[t.grad_fn] = state


def _bound_elsewhere(ctx: Any) -> _FwdState | None:
    """The state of ``ctx`` recorded by another thread (a backward in a device thread)."""
    with _LOCK:
        for calls in _ALL:
            for outputs, state in calls.items:
                if any(t.grad_fn is ctx for t in outputs):
                    _BOUND[ctx] = state
                    return state
    return None


def _infer_device(values: Any) -> str:
    for t in pytree_leaves(values):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.device.type
    return default_device_type()


def _may_backward(values: Any) -> bool:
    """Whether a backward can follow: some tensor input requires grad."""
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree_leaves(values))


def _check_decorated(name: str, fn: object) -> None:
    """Refuse, at decoration time, a first argument that is not the function to decorate."""
    if fn is None or callable(fn):
        return
    if isinstance(fn, (str, torch.device)):
        raise TypeError(
            f"{name} got {fn!r} where the function to decorate goes; the device is a keyword: "
            f"@mixprec.{name}(device_type={str(fn)!r})"
        )
    raise TypeError(
        f"{name} decorates a function, got {type(fn).__name__} {fn!r}; write @mixprec.{name} or "
        f"@mixprec.{name}(...) with keyword arguments"
    )


def _check_cast_dtype(cast_inputs: object) -> None:
    if cast_inputs is None:
        return
    if not isinstance(cast_inputs, torch.dtype) or not cast_inputs.is_floating_point:
        raise ConfigError(
            f"cast_inputs must be None or a floating torch.dtype, got {cast_inputs!r}; "
            "accepted: None, torch.float32, torch.float16, torch.bfloat16"
        )


def custom_fwd(
    fwd: Callable[..., Any] | None = None,
    *,
    device_type: str | torch.device | None = None,
    cast_inputs: torch.dtype | None = None,
) -> Any:
    """Decorate the ``forward`` of a custom ``autograd.Function`` (either style).

    Args:
        fwd: the forward function (omit to get a decorator with these settings).
        device_type: the device whose autocast state applies; ``None`` infers it from the first
            floating tensor argument (else the default device of :class:`mixprec.autocast`).
        cast_inputs: when autocast is enabled, cast floating non-float64 tensors on the device to
            this dtype and run ``forward`` with autocast off; ``None`` runs under the ambient state.

    Example:
        >>> import torch
        >>> import mixprec
        >>> class Square(torch.autograd.Function):
        ...     @staticmethod
        ...     @mixprec.custom_fwd(cast_inputs=torch.float32)
        ...     def forward(x):
        ...         return x * x
        ...     @staticmethod
        ...     def setup_context(ctx, inputs, output):
        ...         ctx.save_for_backward(inputs[0])
        ...     @staticmethod
        ...     @mixprec.custom_bwd
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return 2 * x * g
        >>> x = torch.randn(3, requires_grad=True)
        >>> with mixprec.autocast("cpu", torch.bfloat16):
        ...     y = Square.apply(x.bfloat16())
        >>> y.dtype
        torch.float32
        >>> y.sum().backward()

    Raises:
        TypeError: ``fwd`` is not a function (``custom_fwd("cuda")``, ``custom_fwd(42)``).
        ConfigError: ``cast_inputs`` is not None or a floating dtype; an unknown device type.

    Host sync: none.
    """
    _check_decorated("custom_fwd", fwd)
    _check_cast_dtype(cast_inputs)
    fixed = None if device_type is None else resolve_device_type(device_type)
    if fwd is None:
        return functools.partial(custom_fwd, device_type=fixed, cast_inputs=cast_inputs)
    forward = fwd

    @functools.wraps(forward)
    def decorate_fwd(*args: Any, **kwargs: Any) -> Any:
        has_ctx = bool(args) and isinstance(args[0], FunctionCtx)
        head, inputs = (args[:1], args[1:]) if has_ctx else ((), args)
        dev = fixed or _infer_device((inputs, kwargs))
        enabled = torch.is_autocast_enabled(dev)
        state = _FwdState(dev, enabled and cast_inputs is None, torch.get_autocast_dtype(dev))
        record = not has_ctx and _may_backward((inputs, kwargs))  # before any cast
        if has_ctx:
            setattr(args[0], _ATTR, state)
        else:
            bind_pending()
        if cast_inputs is not None and enabled:
            inputs, kwargs = cast_tree(inputs, kwargs, dev, cast_inputs)
            out = run_without_autocast(dev, forward, *head, *inputs, **kwargs)
        else:
            out = forward(*head, *inputs, **kwargs)
        if record:
            outs = [t for t in pytree_leaves(out) if isinstance(t, torch.Tensor)]
            with _LOCK:
                PENDING.calls.items.append((outs, state))
        return out

    return decorate_fwd


def custom_bwd(
    bwd: Callable[..., Any] | None = None, *, device_type: str | torch.device | None = None
) -> Any:
    """Decorate ``backward``: it runs under the autocast state its ``forward`` saw.

    Args:
        bwd: the backward function (omit to get a decorator).
        device_type: accepted for torch.amp compatibility; the device recorded by
            :func:`custom_fwd` is used.

    Example:
        >>> import torch
        >>> import mixprec
        >>> class Double(torch.autograd.Function):
        ...     @staticmethod
        ...     @mixprec.custom_fwd
        ...     def forward(ctx, x):
        ...         return x * 2
        ...     @staticmethod
        ...     @mixprec.custom_bwd
        ...     def backward(ctx, g):
        ...         return g * 2
        >>> Double.apply(torch.ones(2, requires_grad=True)).sum().backward()

    Raises:
        TypeError: ``bwd`` is not a function (``custom_bwd("cuda")``).
        ConfigError: at backward time, when ``forward`` was not decorated with
            :func:`custom_fwd` (or torch's).

    Host sync: none.
    """
    _check_decorated("custom_bwd", bwd)
    if device_type is not None:
        resolve_device_type(device_type)
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)
    backward = bwd

    @functools.wraps(backward)
    def decorate_bwd(ctx: Any, *grads: Any) -> Any:
        state = _state_of(ctx, device_type)
        with torch.autocast(state.device_type, dtype=state.dtype, enabled=state.enabled):
            return backward(ctx, *grads)

    return decorate_bwd


def _state_of(ctx: Any, device_type: str | torch.device | None) -> _FwdState:
    state = getattr(ctx, _ATTR, None)
    if state is None:
        bind_pending()
        state = _BOUND.get(ctx) or _bound_elsewhere(ctx)
    torch_state = torch_custom_fwd_state(ctx)
    if state is None and torch_state is not None and device_type is not None:
        state = _FwdState(resolve_device_type(device_type), *torch_state)
    if state is None:
        raise ConfigError(
            "mixprec.custom_bwd found no autocast state from forward: decorate the Function's "
            "forward with @mixprec.custom_fwd (under @staticmethod)."
        )
    return state
