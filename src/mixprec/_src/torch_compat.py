"""Every private torch API and every piece of global torch state mixprec touches, in one place.

The rest of the package reaches torch's private names (``torch._C``, ``torch._foreach_*``,
``torch._dynamo``, ``torch._scaled_mm``, module hook dicts, ...) only through this module. Each
entry says what it is for, the torch versions it was checked on, and what mixprec does where the
name is missing; ``tests/test_torch_compat.py`` checks every entry on the torch it runs under.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint as _checkpoint
from torch._compile import _disable_dynamo
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# ---------------------------------------------------------------- kernels, scaling, fp8, devices

# ---------------------------------------------------------------- autocast and the fp8 hook
# Each entry: what it is for; the torch versions it was checked on (2.13.0, 2.14.1); what mixprec
# does where the name is missing. tests/test_autocast_torch_compat.py checks each on the torch it
# runs under.
_Fn = TypeVar("_Fn", bound=Callable[..., Any])

#: ``torch.compiler.disable`` without importing ``torch._dynamo`` (and sympy) at ``import mixprec``:
#: Dynamo runs the function eagerly (a graph break). Checked on 2.13.0, 2.14.1.
disable_dynamo: Callable[[_Fn], _Fn] = _disable_dynamo  # type: ignore[assignment]


def mark_constant(fn: _Fn) -> _Fn:
    """What ``torch.compiler.assume_constant_result`` does (Dynamo runs ``fn`` at trace time and
    guards on its arguments), without importing ``torch._dynamo``. Checked on 2.13.0, 2.14.1
    (``tests/test_autocast_compile.py`` pins that the decorator still does only this).

    Example:
        >>> f = mark_constant(lambda: 0); f._dynamo_marked_constant
        True

    Host sync: none.
    """
    if hasattr(fn, "__dict__"):  # a builtin has nothing to mark
        fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def torch_function_mode_active() -> bool:
    """Whether a ``TorchFunctionMode`` is active (``torch.autocast`` then records itself into a
    pre-dispatch trace). Checked on 2.13.0, 2.14.1.

    Example:
        >>> torch_function_mode_active()
        False

    Host sync: none.
    """
    return bool(torch._C._is_torch_function_mode_enabled())


def autocast_object_enabled(region: torch.autocast) -> bool:
    """Whether a constructed ``torch.autocast`` turned itself on (it may turn itself off with a
    warning, e.g. CUDA requested without CUDA). Checked on 2.13.0, 2.14.1.

    Example:
        >>> autocast_object_enabled(torch.autocast("cpu"))
        True

    Host sync: none.
    """
    return bool(region._enabled)


def backward_pass_autocast() -> Any:
    """AOTAutograd's setting for the autocast state of compiled backwards (process-global:
    ``torch._functorch.config.backward_pass_autocast``). Checked on 2.13.0, 2.14.1.

    Example:
        >>> backward_pass_autocast()
        'same_as_forward'

    Host sync: none.
    """
    import torch._functorch.config as functorch_config

    return functorch_config.backward_pass_autocast


def set_backward_pass_autocast(value: Any) -> None:
    """Set :func:`backward_pass_autocast`. Host sync: none."""
    import torch._functorch.config as functorch_config

    functorch_config.backward_pass_autocast = value


def skip_frames_of(code: CodeType) -> bool:
    """Make Dynamo never compile a frame of ``code`` on its own (it still inlines it into traced
    code): the per-code frame strategy. Checked on 2.13.0; on 2.14.1 Dynamo compiles a hook's
    wrapper frame regardless (issue #32). Returns False, marking nothing, where torch lacks it.

    Example:
        >>> skip_frames_of((lambda: 0).__code__)
        True

    Host sync: none.
    """
    frames: Any = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    strategy = getattr(frames, "set_code_exec_strategy", None)
    if strategy is None:
        return False
    skip = frames._FrameAction.SKIP
    strategy(code, frames._FrameExecStrategy(skip, skip))
    return True


#: The frame object a non-reentrant checkpoint's saved-tensor hook closes over (its
#: ``recompute_fn``); None where torch lacks it (then its recomputation replays nothing, and the
#: recompute tests fail). Checked on 2.13.0, 2.14.1.
CHECKPOINT_FRAME_TYPE: type | None = getattr(_checkpoint, "_CheckpointFrame", None)
#: The code of the reentrant ``CheckpointFunction.forward`` (its ``ctx.run_function``); None where
#: torch lacks it. Checked on 2.13.0, 2.14.1.
REENTRANT_CHECKPOINT_CODE: CodeType | None = getattr(
    getattr(getattr(_checkpoint, "CheckpointFunction", None), "forward", None), "__code__", None
)


def top_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The innermost ``saved_tensors_hooks`` pair (a non-reentrant checkpoint's forward pushes
    one), or None. Checked on 2.13.0, 2.14.1.

    Example:
        >>> top_saved_tensors_hooks() is None
        True

    Host sync: none.
    """
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def caller_frame(depth: int) -> FrameType:
    """The Python frame ``depth`` levels above the caller (0: the caller's own), whose
    ``f_back`` chain a reentrant checkpoint's forward is found in by its code. CPython's
    ``sys._getframe``; checked on 3.10-3.12.

    Example:
        >>> caller_frame(0).f_code.co_name
        '<module>'

    Host sync: none.
    """
    return sys._getframe(depth + 1)


#: The leaves of a nested structure of outputs (``torch.utils._pytree``; no public equivalent).
#: Checked on 2.13.0, 2.14.1.
pytree_leaves = tree_leaves
#: The base class of a dispatch mode (the dtype report observes aten ops with one;
#: ``torch.utils._python_dispatch``, no public equivalent). Checked on 2.13.0, 2.14.1.
DispatchMode = TorchDispatchMode
