"""The native autocast state a region switches, and its weight-cache decision.

A region without a policy or a report does exactly what ``torch.autocast.__enter__`` and
``__exit__`` do to the thread-local autocast state (torch 2.13, ``torch/amp/autocast_mode.py``),
in the same order, without building a ``torch.autocast`` object per region (its constructor
re-validates what the region validated already; ``benchmarks/bench_autocast.py --region`` times
the region). Where torch's
object does more (a ``TorchFunctionMode`` is active, e.g. ``torch.export``'s pre-dispatch trace,
which records regions into the graph), the region builds one instead (:func:`push` says so).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

Saved = tuple[bool, torch.dtype, bool]


def cache_for(requested: bool | None, device: str, dtype: torch.dtype) -> bool:
    """The weight-cast cache setting a region enters with.

    ``None``: off where a backward can follow (grad mode on), so that checkpoint recomputation
    dispatches the same casts as its forward; off in a nested region that switches to another low
    dtype (the native cache is keyed by the source tensor only); else the current setting, as
    torch.

    Example:
        >>> import torch
        >>> cache_for(None, "cpu", torch.bfloat16), cache_for(True, "cpu", torch.bfloat16)
        (False, True)

    Host sync: none.
    """
    if requested is not None:
        return requested
    if torch.is_grad_enabled():
        return False
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != dtype:
        return False
    return torch.is_autocast_cache_enabled()


def push(device: str, enabled: bool, dtype: torch.dtype, requested: bool | None) -> Saved | None:
    """Switch the native state as ``torch.autocast.__enter__`` does and return what to restore;
    None, touching nothing, where a ``torch.autocast`` object must do it (a function mode is
    active, e.g. ``torch.export``'s pre-dispatch trace, which records regions into the graph).

    Example:
        >>> import torch
        >>> saved = push("cpu", True, torch.bfloat16, None)
        >>> torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled()
        (True, False)
        >>> pop("cpu", saved)
        >>> torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled()
        (False, True)

    Host sync: none.
    """
    if torch._C._is_torch_function_mode_enabled():
        return None
    cache = cache_for(requested, device, dtype)
    saved = (
        torch.is_autocast_enabled(device),
        torch.get_autocast_dtype(device),
        torch.is_autocast_cache_enabled(),
    )
    torch.set_autocast_enabled(device, enabled)
    torch.set_autocast_dtype(device, dtype)
    torch.autocast_increment_nesting()
    torch.set_autocast_cache_enabled(cache)
    return saved


def pop(device: str, saved: Saved) -> None:
    """Restore as ``torch.autocast.__exit__`` does (the outermost exit clears the weight cache).

    Example:
        >>> import torch
        >>> pop("cpu", push("cpu", True, torch.float16, True))
        >>> torch.is_autocast_enabled("cpu")
        False

    Host sync: none.
    """
    if torch.autocast_decrement_nesting() == 0:
        torch.clear_autocast_cache()
    torch.set_autocast_enabled(device, saved[0])
    torch.set_autocast_dtype(device, saved[1])
    torch.set_autocast_cache_enabled(saved[2])


NATIVE: dict[tuple[str, torch.dtype], tuple[bool, tuple[tuple[str, type[Warning]], ...]]] = {}


def native_decision(device: str, dtype: torch.dtype) -> tuple[bool, tuple[Any, ...]]:
    """Whether ``torch.autocast(device, dtype)`` enables itself here, and the warnings it gives
    (e.g. CUDA requested on a machine without CUDA). Asked once per (device, dtype); torch's
    errors (CUDA bfloat16 on a GPU without it) propagate, at construction, as with torch.

    Example:
        >>> import torch
        >>> native_decision("cpu", torch.bfloat16)
        (True, ())

    Host sync: none.
    """
    found = NATIVE.get((device, dtype))
    if found is None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            native = torch.autocast(device, dtype=dtype, enabled=True)
        notes = tuple((str(w.message), w.category) for w in caught)
        found = NATIVE[(device, dtype)] = (bool(native._enabled), notes)
    return found
