"""Checkpoint recomputation replays the op rules its forward ran with.

``torch.utils.checkpoint`` recomputes a function in backward, outside the region, restoring
native autocast but not mixprec's op-rule mode (a ``TorchFunctionMode``), so a recompute would
run the ops without their rules (non-reentrant checkpoint then fails its metadata check;
reentrant checkpoint silently computes different gradients). When an op rule applies inside a
checkpointed forward, mixprec wraps that checkpoint's recompute function so that it runs under
the same rule table. Module rules need no wrapper: their per-module hooks replay themselves.

This reads two private parts of ``torch.utils.checkpoint`` (torch 2.13): the
``_CheckpointFrame`` that the non-reentrant forward's saved-tensor hook closes over (its
``recompute_fn``) and the ``ctx.run_function`` of the reentrant ``CheckpointFunction``. If a
torch release moves them, :func:`current_checkpoint` finds nothing and the recompute tests fail.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils.checkpoint as _ckpt

from mixprec._src.autocast.rules import Rule

_FRAME_TYPE: type | None = getattr(_ckpt, "_CheckpointFrame", None)
_REENTRANT_FORWARD = getattr(getattr(_ckpt, "CheckpointFunction", None), "forward", None)
_REENTRANT_CODE = getattr(_REENTRANT_FORWARD, "__code__", None)
_REPLAYS = "_mixprec_replays"  # attribute of a wrapper: the tables it replays

Target = tuple[Any, str]  # (object, attribute holding the recompute function)


def current_checkpoint() -> Target | None:
    """The checkpoint whose forward is running now (the innermost), or None.

    Example:
        >>> current_checkpoint() is None
        True

    Host sync: none.
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and _FRAME_TYPE is not None:  # non-reentrant forward (or other hooks)
        for cell in getattr(hooks[0], "__closure__", None) or ():
            if isinstance(cell.cell_contents, _FRAME_TYPE):
                return cell.cell_contents, "recompute_fn"
        return None
    if torch.is_grad_enabled() or _REENTRANT_CODE is None:
        return None
    frame = sys._getframe(1)  # reentrant checkpoint runs its forward under no_grad
    while frame is not None:
        if frame.f_code is _REENTRANT_CODE:
            ctx = frame.f_locals.get("ctx")
            return None if ctx is None else (ctx, "run_function")
        frame = frame.f_back  # type: ignore[assignment]
    return None


def replay_in(
    target: Target,
    table: Mapping[str, Rule],
    device_type: str,
    make_mode: Callable[[Mapping[str, Rule], str], Any],
) -> None:
    """Make the checkpoint ``target`` recompute under the op rules ``table`` (once per table).

    Example:
        >>> class Holder:
        ...     run_function = staticmethod(lambda: 1)
        >>> from contextlib import nullcontext
        >>> h = Holder()
        >>> replay_in((h, "run_function"), {}, "cpu", lambda t, d: nullcontext())
        >>> h.run_function()
        1

    Host sync: none.
    """
    owner, attr = target
    fn = getattr(owner, attr)
    replays = getattr(fn, _REPLAYS, ())
    if any(t is table for t, _ in replays):
        return

    def recompute(*args: Any, **kwargs: Any) -> Any:
        with make_mode(table, device_type):
            return fn(*args, **kwargs)

    setattr(recompute, _REPLAYS, (*replays, (table, device_type)))
    setattr(owner, attr, recompute)
