"""Every private torch API and every piece of global torch state mixprec touches, in one place.

The rest of the package reaches torch's private names (``torch._C``, ``torch._foreach_*``,
``torch._dynamo``, ``torch._scaled_mm``, module hook dicts, ...) only through this module. Each
entry says what it is for, the torch versions it was checked on, and what mixprec does where the
name is missing; ``tests/test_torch_compat.py`` checks every entry on the torch it runs under.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as _pytree

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


#: The pytree helpers (``torch.utils._pytree``; torch has no public module for them in 2.14.1).
tree_flatten = _pytree.tree_flatten
tree_map = _pytree.tree_map


# ---------------------------------------------------------------- autocast and the fp8 hook
