"""Every private torch API and every piece of global torch state mixprec touches, in one place.

The rest of the package reaches torch's private names (``torch._C``, ``torch._foreach_*``,
``torch._dynamo``, ``torch._scaled_mm``, module hook dicts, ...), the layout of its private
classes (FSDP2's parameters, the checkpoint's frames) and torch's attributes by computed names
only through this module (``tests/test_torch_door.py`` finds any other use, by rule). Each entry
says what it is for, the torch versions it was checked on, and what mixprec does where the name
is missing; ``tests/test_torch_compat.py`` and ``tests/autocast/test_autocast_torch_compat.py``
check every entry on the torch they run under.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, TypeVar

import torch
import torch.utils._pytree as _pytree
import torch.utils.checkpoint as _checkpoint
from torch._compile import _disable_dynamo
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.conv import _ConvNd
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mixprec._src.torch_compat.fsdp import (
    fsdp_attach_extension as fsdp_attach_extension,
)
from mixprec._src.torch_compat.fsdp import (
    fsdp_extension_ready as fsdp_extension_ready,
)
from mixprec._src.torch_compat.fsdp import (
    fsdp_keeps_unsharded as fsdp_keeps_unsharded,
)
from mixprec._src.torch_compat.fsdp import (
    fsdp_lazy_init as fsdp_lazy_init,
)
from mixprec._src.torch_compat.fsdp import (
    fsdp_padded_shard as fsdp_padded_shard,
)
from mixprec._src.torch_compat.fsdp import (
    fsdp_param_dtype as fsdp_param_dtype,
)
from mixprec._src.torch_compat.fsdp import (
    fsdp_param_group as fsdp_param_group,
)
from mixprec._src.torch_compat.fsdp import (
    fsdp_param_owners as fsdp_param_owners,
)
from mixprec._src.torch_compat.fsdp import (
    fsdp_params as fsdp_params,
)
from mixprec._src.torch_compat.fsdp import (
    fsdp_post_forward_shards as fsdp_post_forward_shards,
)
from mixprec._src.torch_compat.fsdp import (
    fsdp_shard_info as fsdp_shard_info,
)
from mixprec._src.torch_compat.fsdp import (
    fsdp_sharded_param as fsdp_sharded_param,
)
from mixprec._src.torch_compat.fsdp import (
    fsdp_unsupported as fsdp_unsupported,
)
from mixprec._src.torch_compat.module_hooks import (
    GlobalModuleHooks as GlobalModuleHooks,
)
from mixprec._src.torch_compat.module_hooks import (
    compiled_in_place as compiled_in_place,
)

# ---------------------------------------------------------------- kernels, scaling, fp8, devices
#
# Checked on torch 2.12.1 (the oldest declared), 2.13.0 (pinned) and 2.14.1 (the newest
# installable): tests/test_torch_compat.py on each, in CI. Every name below exists on all three,
# and on 2.8.0 too; where one is missing (a torch outside the declared range), ``import mixprec``
# fails with torch's AttributeError naming it.

#: The installed torch's release, ``(major, minor)`` (``"2.14.1+cu130"``: ``(2, 14)``), for tables
#: that differ between releases (autocast/native.py's op table).
TORCH_RELEASE: tuple[int, int] = (
    int(torch.__version__.split(".")[0]),
    int(torch.__version__.split(".")[1]),
)

#: ``_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``: multiplies every
#: grad by ``inv_scale`` in place and sets ``found_inf`` to 1 if any *input* value is inf/NaN. The
#: kernel torch's GradScaler runs (CPU and CUDA; devices.py's ``amp_kernels`` column says where).
amp_unscale_and_check_ = torch._amp_foreach_non_finite_check_and_unscale_

#: ``_amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, interval)``: torch's
#: in-place scale update (the device form of scaling/rule.py).
amp_update_scale_ = torch._amp_update_scale_

#: The foreach kernels (one launch per group of tensors; on the CPU a loop in C++).
foreach_mul_ = torch._foreach_mul_
foreach_norm = torch._foreach_norm
foreach_clamp_min_ = torch._foreach_clamp_min_
foreach_clamp_max_ = torch._foreach_clamp_max_
foreach_copy_ = torch._foreach_copy_

#: ``_scaled_mm``: the tensorwise and rowwise fp8 matmul (the block-scaled ones are the public
#: ``F.scaled_mm``, in every declared release) (a fast kernel on CUDA with fp8 support;
#: on the CPU oneDNN's reference kernel, which mixprec never calls).
scaled_mm = torch._scaled_mm


def running_backward() -> bool:
    """Whether the calling thread is inside an autograd backward (a checkpoint recomputation runs
    its forward there). Reads ``torch._C._current_graph_task_id()`` (-1 outside backward).

    Host sync: none.
    """
    return bool(torch._C._current_graph_task_id() != -1)


def version_counter(tensor: torch.Tensor) -> int:
    """``tensor._version``: the count of in-place changes autograd keeps per tensor storage view.

    Host sync: none.
    """
    return int(tensor._version)


def tensor_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor._base``: the tensor ``tensor`` is a view of (None when it owns its storage view:
    autograd's own gradients do). kernels/plan.py tells flat gradient views by it, the dry run a
    saved view of a parameter (a transposed weight). Checked on
    2.12.1, 2.13.0 and 2.14.1.

    Host sync: none.
    """
    return tensor._base


def process_group_device_types(group: Any) -> set[str]:
    """The device types a ``ProcessGroup``'s backends can reduce on (``ProcessGroup.
    _device_types``); raises AttributeError where a torch lacks it (dist/agree.py then asks the
    backend's name). Checked on 2.12.1, 2.13.0 and 2.14.1.

    Host sync: none.
    """
    return {d.type for d in group._device_types}


def steps_with_amp_scaling(optimizer: Any) -> bool:
    """Whether ``optimizer`` says it takes the scaler's ``grad_scale``/``found_inf`` (torch's
    fused optimizers and others that follow torch's contract set ``_step_supports_amp_scaling``).

    Host sync: none.
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def without_dynamo_wrapper(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with the wrappers ``torch.optim`` puts around its methods removed
    (``torch._disable_dynamo`` on ``add_param_group``/``zero_grad``, the graph break on ``step``;
    each imports ``torch._dynamo`` at its first call). They are ``functools.wraps`` wrappers, so
    ``inspect.unwrap`` finds the plain function; where a torch has none, ``function`` itself.

    Host sync: none.
    """
    return inspect.unwrap(function)


def sparse_values(grad: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse COO ``grad`` (``Tensor._values()``: the public ``values()``
    refuses an uncoalesced tensor, and an embedding's sparse gradient is one). A view: writes
    into it change ``grad``. Checked on 2.13.0.

    Host sync: none.
    """
    return grad._values()


#: The pytree helpers (``torch.utils._pytree``; torch has no public module for them in 2.14.1).
tree_flatten = _pytree.tree_flatten
tree_map = _pytree.tree_map

#: ``aten._unsafe_view``: the view ATen's own kernels return (e.g. a reshape of a matmul's
#: output); fp8/carrier.py lets it through as an alias of the gathered weight. An ATen op, not a
#: Python API, but private by name. Checked on 2.12.1, 2.13.0, 2.14.1.
aten_unsafe_view = torch.ops.aten._unsafe_view.default


def preserve_version_counter(tensor: torch.Tensor) -> Any:
    """A context in which writes into ``tensor`` leave its version counter (and its views')
    as it was: FSDP2 refills its all-gather buffers the same way, so that the tensors autograd
    saved from them stay valid."""
    return torch.autograd.grad_mode._unsafe_preserve_version_counter(tensor)


def wrapper_subclass(cls: type, shape: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """``torch.Tensor._make_wrapper_subclass``: a tensor subclass instance without storage."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)


disabled_torch_function = torch._C._disabled_torch_function_impl


def dynamo_disable(fn: Any) -> Any:
    """``torch._dynamo.disable``: ``fn`` runs eagerly when a compiled model calls it."""
    import torch._dynamo

    return torch._dynamo.disable(fn)


# ---------------------------------------------------------------- autocast and the fp8 hook
# Each entry: what it is for; the torch versions it was checked on (2.13.0, 2.14.1); what mixprec
# does where the name is missing. tests/autocast/test_autocast_torch_compat.py checks each on the
# torch it runs under.
_Fn = TypeVar("_Fn", bound=Callable[..., Any])

#: ``torch.compiler.disable`` without importing ``torch._dynamo`` (and sympy) at ``import mixprec``:
#: Dynamo runs the function eagerly (a graph break). Checked on 2.13.0, 2.14.1.
disable_dynamo: Callable[[_Fn], _Fn] = _disable_dynamo  # type: ignore[assignment]


def mark_constant(fn: _Fn) -> _Fn:
    """What ``torch.compiler.assume_constant_result`` does (Dynamo runs ``fn`` at trace time and
    guards on its arguments), without importing ``torch._dynamo``. Checked on 2.13.0, 2.14.1
    (``tests/autocast/test_autocast_compile.py`` pins that the decorator still does only this).

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


#: A running checkpoint's recompute function, as where it is held: ``(holder, attribute)``, the
#: reentrant ``CheckpointFunction``'s ``ctx`` and ``"run_function"``, or the non-reentrant
#: ``_CheckpointFrame`` and ``"recompute_fn"``.
CheckpointTarget = tuple[Any, str]


def _reentrant_checkpoint(frame: FrameType | None) -> CheckpointTarget | None:
    """The ``ctx`` of ``CheckpointFunction.forward`` among ``frame`` and its callers."""
    while frame is not None:
        if frame.f_code is REENTRANT_CHECKPOINT_CODE:
            ctx = frame.f_locals.get("ctx")
            return None if ctx is None else (ctx, "run_function")
        frame = frame.f_back
    return None


def _non_reentrant_checkpoint() -> CheckpointTarget | None:
    """The ``_CheckpointFrame`` the innermost saved-tensor pack hook closes over."""
    hooks = top_saved_tensors_hooks()
    if hooks is None or CHECKPOINT_FRAME_TYPE is None:
        return None
    for cell in getattr(hooks[0], "__closure__", None) or ():
        if isinstance(cell.cell_contents, CHECKPOINT_FRAME_TYPE):
            return cell.cell_contents, "recompute_fn"
    return None


def running_checkpoints() -> list[CheckpointTarget]:
    """The checkpoints whose forwards are running now that a recomputation would replay,
    innermost first: the innermost reentrant one (its forward runs under no_grad, so under
    no_grad it is inside any non-reentrant one that saves anything) and the non-reentrant one
    whose saved-tensor hooks are the innermost. Other saved-tensor hooks (``save_on_cpu``, a
    recomputation's own) hide no reentrant checkpoint. Checked on 2.13.0; where torch moves
    either, it is not found and autocast's recompute tests fail.

    Example:
        >>> running_checkpoints()
        []

    Host sync: none.
    """
    found = []
    if not torch.is_grad_enabled() and REENTRANT_CHECKPOINT_CODE is not None:
        found.append(_reentrant_checkpoint(sys._getframe(1)))
    found.append(_non_reentrant_checkpoint())
    return [t for t in found if t is not None]


def recompute_function(target: CheckpointTarget) -> Callable[..., Any]:
    """The function ``target``'s checkpoint will run to recompute its forward. Host sync: none."""
    holder, attribute = target
    return getattr(holder, attribute)


def set_recompute_function(target: CheckpointTarget, fn: Callable[..., Any]) -> None:
    """Make ``target``'s checkpoint recompute its forward with ``fn`` (a wrapper of
    :func:`recompute_function`). Checked on 2.13.0. Host sync: none."""
    holder, attribute = target
    setattr(holder, attribute, fn)


#: The leaves of a nested structure of outputs (``torch.utils._pytree``; no public equivalent).
#: Checked on 2.13.0, 2.14.1.
pytree_leaves = tree_leaves
#: The base class of a dispatch mode (the dtype report observes aten ops with one;
#: ``torch.utils._python_dispatch``, no public equivalent). Checked on 2.13.0, 2.14.1.
DispatchMode = TorchDispatchMode


def op_name(func: Any) -> str:
    """An aten op's name as the dispatcher spells it (``aten::mm``, ``aten::add.Tensor``: the
    overload after a dot unless it is the default), read from ``OpOverload.name()``; ``str``
    of anything else a dispatch mode sees (a higher-order op). ``torch._ops.OpOverload`` is
    private by module. Checked on 2.13.0.

    Example:
        >>> op_name(torch.ops.aten.add.Tensor), op_name(torch.ops.aten.mm.default)
        ('aten::add.Tensor', 'aten::mm')

    Host sync: none.
    """
    if isinstance(func, torch._ops.OpOverload):
        return str(func.name())
    return str(func)


#: A module's children by attribute name (``nn.Module._modules``; ``named_children()`` builds a
#: generator per call, on the per-module-call path). Checked on 2.12.1, 2.13.0, 2.14.1.
def submodules(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """``module``'s direct children by name (the live dict: read it, never write it).

    Example:
        >>> list(submodules(torch.nn.Sequential(torch.nn.ReLU())))
        ['0']

    Host sync: none.
    """
    return module._modules


#: The dispatcher's registry, read by autocast/native.py's op table: every op name, and an op's
#: registrations as text (one line per dispatch key, ``AutocastCPU: registered at ...``). No
#: public equivalent. Checked on 2.12.1, 2.13.0, 2.14.1.
dispatch_op_names: Callable[[], list[str]] = torch._C._dispatch_get_all_op_names
dispatch_dump: Callable[[str], str] = torch._C._dispatch_dump


def torch_custom_fwd_state(ctx: Any) -> tuple[bool, torch.dtype] | None:
    """What ``torch.amp.custom_fwd`` recorded on a Function's ``ctx``: whether autocast was on in
    forward, and its dtype (``ctx._fwd_used_autocast``, ``ctx._dtype``); None for a ``ctx``
    torch's decorator did not see. Checked on 2.12.1, 2.13.0 and 2.14.1.

    Host sync: none.
    """
    if not hasattr(ctx, "_fwd_used_autocast"):
        return None
    return bool(ctx._fwd_used_autocast), ctx._dtype


# ---------------------------------------------------------------- names computed at run time
# A name computed at run time (a dtype's, a device type's, a user's) reaches torch only through
# these, which refuse private names. They use Python's getattr and no torch API of their own:
# checked on 2.13.0, tested on every torch CI runs (tests/test_torch_compat.py).


def _refuse_private(name: str) -> None:
    if name.startswith("_"):
        raise AttributeError(f"{name!r} is private: mixprec reaches it only through torch_compat")


def public_attr(obj: Any, name: str, *default: Any) -> Any:
    """``getattr(obj, name[, default])`` for a ``name`` computed at run time (a dtype's, a device
    type's, a class's or a user-written name), never a private one: a ``_``-prefixed name raises
    AttributeError, or returns ``default`` when one is given. So no computed name reaches torch's
    internals past this module.

    Example:
        >>> public_attr(torch, "bfloat16"), public_attr(torch, "_C", None)
        (torch.bfloat16, None)

    Host sync: none.
    """
    if name.startswith("_") and default:
        return default[0]
    _refuse_private(name)
    return getattr(obj, name, *default)


def has_public_attr(obj: Any, name: str) -> bool:
    """``hasattr(obj, name)`` for a computed ``name``: False for a private one. Host sync: none."""
    return not name.startswith("_") and hasattr(obj, name)


def set_public_attr(obj: Any, name: str, value: Any) -> None:
    """``setattr(obj, name, value)`` for a computed public ``name`` (a module's buffer by the name
    ``named_buffers`` gave it); a private one raises AttributeError. Host sync: none."""
    _refuse_private(name)
    setattr(obj, name, value)


def aten_op(name: str) -> Any:
    """The aten op packet called ``name`` (``"mm"``, ``"_softmax"``: aten's own names, whose
    ``_`` means ATen-internal, not private to Python), or None.

    Example:
        >>> aten_op("mm") is torch.ops.aten.mm, aten_op("no_such_op")
        (True, None)

    Host sync: none.
    """
    return getattr(torch.ops.aten, name, None)


# ---------------------------------------------------------------- the advisor
# Checked on 2.13.0 (pinned), and on the other torches CI runs where an entry says so.


#: The attribute of torch.compile's ``OptimizedModule`` that holds the eager module: its modules
#: are named ``_orig_mod.<name>``, and a user passes it to the advisor. Checked on 2.13.0.
COMPILED_INNER = "_orig_mod"


def is_compiled_module(module: object) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (``OptimizedModule``, whose
    ``_orig_mod`` is the eager module). The advisor refuses such a module: its modules are
    named ``_orig_mod.<name>``, where a policy names them without it.

    Checked on torch 2.12.1, 2.13.0 and 2.14.1 (``torch._dynamo.eval_frame.
    OptimizedModule``). Nothing is imported: where dynamo was never imported, nothing was
    compiled.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and isinstance(module, optimized)


def compiled_runs_eagerly() -> contextlib.AbstractContextManager[Any]:
    """A context in which compiled code runs its eager Python: a module compiled in place
    (``Module.compile()``) or any function ``torch.compile`` made (the global stance
    ``torch.compiler.set_stance("force_eager")``, restored on exit). The advisor's passes run
    in it: their forward hooks, regions and fp8 statistics need the eager forward.

    Checked on torch 2.13.0. Nothing is imported where dynamo was never imported (nothing was
    compiled).

    Host sync: none.
    """
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def cpu_flash_attention_formulas(
    forward: Callable[..., int], backward: Callable[..., int]
) -> dict[Any, Callable[..., int]]:
    """``FlopCounterMode`` ``custom_mapping`` entries for the CPU flash-attention kernels
    (``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``), which torch's
    counter has no formula for: ``forward``/``backward`` take the ops' tensors (flagged
    ``_get_raw``, so the counter passes tensors rather than shapes). An op torch lacks is left
    out. Checked on 2.13.0.

    Host sync: none.
    """
    aten = torch.ops.aten
    found = {}
    for name, fn in (
        ("_scaled_dot_product_flash_attention_for_cpu", forward),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", backward),
    ):
        op = getattr(aten, name, None)
        if op is not None:
            fn._get_raw = True  # type: ignore[attr-defined]
            found[op] = fn
    return found


#: The private base classes of torch's batch and instance norms and of its convolutions, which
#: the advisor recognizes by (``nn.modules.batchnorm._NormBase``, ``nn.modules.conv._ConvNd``).
#: Checked on 2.12.1, 2.13.0 and 2.14.1.
NORM_BASE: type[_NormBase] = _NormBase
CONV_BASE: type[_ConvNd] = _ConvNd


# ---------------------------------------------------------------- the dry run


def fake_tensor_mode() -> contextlib.AbstractContextManager[Any]:
    """torch's ``FakeTensorMode`` (``torch._subclasses.fake_tensor``): tensors with shapes,
    dtypes and a device but no data, that carry their device's dispatch keys (autocast
    included). The dry run measures what bf16 autocast saves for backward in one. Checked on
    torch 2.13.0.

    Host sync: none.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()
