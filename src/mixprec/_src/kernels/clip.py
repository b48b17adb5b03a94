"""Unscale fused with gradient clipping: two passes over the grads instead of three.

torch's sequence ``unscale_(opt); clip_grad_norm_(params, max_norm)`` reads and writes every grad
to unscale it, reads it again for the norm, then reads and writes it again to clip. The norm of
the *scaled* grads divided by the scale is the norm of the unscaled grads (every p-norm with
``p > 0`` is homogeneous), so two passes are enough:

1. the norm of the scaled grads (``torch._foreach_norm``, or ``aminmax`` for the inf-norm on the
   CPU), per (device, dtype) group or on a group's flat range;
2. one multiply by ``min(1, max_norm / (norm / scale + 1e-6)) / scale``, computed on the device.

With a power-of-two scale (the default trajectory) both the returned norm and the clipped grads
are bit-identical to torch's sequence; otherwise they agree to float32 rounding. Nothing here reads
a value on the host except ``error_if_nonfinite=True``.

A third way (``defer=True``) only measures: the caller folds the clip coefficient into a fused
optimizer's ``grad_scale``, so the grads are read once for the norm and once by the optimizer, or
(a non-fused step) multiplies by ``coefficient / scale`` with the unscale kernel.

Implementation choice per device type (the device types are columns of
:mod:`mixprec._src.devices`; the measurements behind it: ``docs/performance.md``):

* Norms: ``torch._foreach_norm`` on every device for finite ``p``. For ``p = inf`` the CPU uses
  ``torch.aminmax`` per tensor (``max(max, -min)``, NaN-propagating like the norm), because the
  CPU kernel of ``_foreach_norm(..., inf)`` is not vectorised. CUDA keeps ``_foreach_norm`` (one
  multi-tensor launch for all tensors).
* Multiply: on CPU and CUDA, fp32 groups go through
  ``torch._amp_foreach_non_finite_check_and_unscale_`` (the same product as ``_foreach_mul_``,
  faster per tensor on the CPU, and it flags non-finite *scaled* grads for free, which is exactly
  torch's ``unscale_`` overflow test). Other dtypes and devices use ``torch._foreach_mul_`` and
  take the overflow flag from the norm (non-finite norm <=> some grad is non-finite).
* Value clipping: unscale + check (:func:`mixprec._src.kernels.unscale.unscale_grads_`), then the
  clamp. On the CPU, tensors of more than 32768 elements on average get one ``clamp_`` each (one
  pass, against two for ``_foreach_clamp_min_`` + ``_foreach_clamp_max_``), smaller ones the two
  foreach clamps (where the per-call overhead dominates). Elsewhere the two foreach clamps (one
  launch each on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from mixprec._src import torch_compat
from mixprec._src.devices import caps
from mixprec._src.kernels.plan import GradPlan, GroupKey, group_grads
from mixprec._src.kernels.unscale import found_inf_on
from mixprec.errors import ConfigError, NonFiniteNormError

_BIG = 32768  # elements per tensor above which one clamp_ pass beats two foreach passes (CPU)


def validate_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float, after checking it is > 0 (``inf`` allowed).

    Raises:
        ConfigError: ``norm_type`` is not a number, NaN, zero or negative.
    """
    try:
        value = float(norm_type)
    except (TypeError, ValueError):
        value = math.nan
    if not value > 0:
        raise ConfigError(
            f"norm_type must be a number > 0 or float('inf'), got {norm_type!r}. Only those "
            "norms are divided exactly by the scale and turn inf/NaN whenever a gradient does; "
            "use scaler.unscale_(optimizer) then torch.nn.utils.clip_grad_norm_ for others."
        )
    return value


def validate_plan(plan: GradPlan, what: str) -> None:
    """Reject sparse grads (torch's clipping does not support them either)."""
    if plan.sparse:
        names = ", ".join(ref.describe() for ref in plan.sparse[:8])
        raise ConfigError(
            f"scaler.{what}() does not support sparse gradients ({names}). Call "
            "scaler.unscale_(optimizer) and clip the dense gradients yourself, or build the "
            "embedding with sparse=False."
        )


def validated_limit(value: float, name: str) -> float:
    """``value`` as a float >= 0 (inf allowed).

    Raises:
        ConfigError: not a number, NaN or negative.
    """
    try:
        limit = float(value)
    except (TypeError, ValueError, OverflowError):
        limit = math.nan
    if not limit >= 0:
        raise ConfigError(f"{name} must be a number >= 0 (inf allowed), got {value!r}.")
    return limit


def grouped_like(
    parameters: Iterable[torch.Tensor] | torch.Tensor, grads: Iterable[torch.Tensor]
) -> dict[GroupKey, list[torch.Tensor]]:
    """The grads of ``parameters`` grouped and ordered as ``torch.nn.utils.clip_grad_norm_``
    groups them, after checking that they are exactly ``grads`` (the optimizer's).

    Raises:
        ConfigError: some grads are not the optimizer's, or some of the optimizer's are missing.
    """
    listed = group_grads([parameters] if isinstance(parameters, torch.Tensor) else parameters)
    ours = {id(g) for g in grads}
    theirs = {id(g) for group in listed.values() for g in group}
    if ours != theirs:
        raise ConfigError(
            "clip_grad_norm_(..., parameters=...) must list exactly the parameters whose "
            f"gradients the optimizer holds ({len(ours)} with a grad); of the {len(theirs)} "
            f"gradients given, {len(theirs - ours)} are not the optimizer's, and "
            f"{len(ours - theirs)} of the optimizer's are missing. Pass the parameters the "
            "optimizer was built from (e.g. model.parameters()), or leave parameters out."
        )
    return listed


class Clip(NamedTuple):
    """What :func:`clip_grad_norm_` computed: 0-d tensors on the first grad's device.

    Attributes:
        total: the total norm of the unscaled grads (before clipping).
        coefficient: ``min(1, max_norm / (total + 1e-6))``, the factor the unscaled grads are
            (or, deferred, are to be) multiplied by.
    """

    total: torch.Tensor
    coefficient: torch.Tensor


def clip_grad_norm_(
    plan: GradPlan,
    inv_scale: torch.Tensor,
    found_inf_per_device: dict[torch.device, torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    check_output: bool,
    error_if_nonfinite: bool = False,
    reduce_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    norm_groups: dict[GroupKey, list[torch.Tensor]] | None = None,
    defer: bool = False,
) -> Clip:
    """Unscale and clip the grads of ``plan`` in place (or only measure, ``defer``).

    Args:
        plan: the grads (dense only; see :func:`validate_plan`).
        inv_scale: 0-d float32 tensor, ``1 / scale``.
        found_inf_per_device: filled with one 0-d float32 flag per grad device, non-zero when a
            grad is inf/NaN (or, with ``check_output``, when unscaling overflows).
        max_norm: the largest total norm left after clipping.
        norm_type: ``p`` of the p-norm, > 0 or inf (see :func:`validate_norm_type`).
        check_output: the scale may be below 1, so unscaling itself may overflow: flag a
            non-finite unscaled norm too.
        error_if_nonfinite: raise :class:`NonFiniteNormError` before touching anything when the
            norm is inf/NaN (reads the norm: one host sync).
        reduce_norm: sharded grads: turns this rank's scaled norm into the global one (one
            all-reduce, :func:`mixprec.distributed.all_reduce_norm_`). The flags then also take
            the global norm's non-finiteness, so every rank agrees without another collective.
        norm_groups: the same grads grouped and ordered as the norm should sum them (see
            :func:`~mixprec._src.kernels.plan.group_grads`); default: ``plan``'s groups.
        defer: leave the grads as they are (the caller applies the coefficient later, e.g.
            inside a fused optimizer's ``grad_scale``); the flags then come from the norm alone.

    Host sync: none, unless ``error_if_nonfinite``.
    """
    groups = plan.kernel_groups()
    total = _total_norm(norm_groups or groups, inv_scale, norm_type, reduce_norm)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise NonFiniteNormError(
            f"The total norm of order {norm_type} of the unscaled gradients is non-finite "
            f"({total.item()}), so it cannot be clipped; nothing was changed. This iteration "
            "overflowed: pass error_if_nonfinite=False and scaler.step() skips it and "
            "scaler.update() lowers the scale."
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    non_finite = torch.logical_not(torch.isfinite(total)).to(torch.float32)
    check_output = check_output or reduce_norm is not None  # flags = max(local, global)
    multiplier = coefficient * inv_scale.to(total.device)
    with torch.no_grad():
        for key, grads in groups.items():
            if defer:
                found = found_inf_on(found_inf_per_device, key[0])
                torch.maximum(found, non_finite.to(key[0]), out=found)
            else:
                _multiply_(key, grads, multiplier, non_finite, found_inf_per_device, check_output)
    return Clip(total, coefficient)


def _total_norm(
    groups: dict[GroupKey, list[torch.Tensor]],
    inv_scale: torch.Tensor,
    norm_type: float,
    reduce_norm: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    """The total norm of the unscaled grads: the scaled norm times ``1/scale``."""
    if not groups:
        zero = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
        return zero if reduce_norm is None else reduce_norm(zero) * inv_scale  # no rank hangs
    first_device = next(iter(groups))[0]
    norms = [_group_norms(grads, norm_type).to(first_device) for grads in groups.values()]
    scaled_total = torch.linalg.vector_norm(torch.cat(norms), norm_type)
    if reduce_norm is not None:
        scaled_total = reduce_norm(scaled_total)
    return scaled_total * inv_scale.to(first_device)


def _group_norms(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The per-tensor norms of one (device, dtype) group, as a 1-D tensor."""
    if norm_type == math.inf:
        # The inf-norm has no identity: empty grads (which torch rejects) contribute nothing.
        grads = [g for g in grads if g.numel()]
        if not grads:
            return torch.zeros(1, dtype=torch.float32)
        if caps(grads[0].device).aminmax_inf_norm:
            pairs = [torch.aminmax(g) for g in grads]
            lows = torch.stack([pair.min for pair in pairs])
            highs = torch.stack([pair.max for pair in pairs])
            return torch.maximum(highs, lows.neg())
    return torch.stack(torch_compat.foreach_norm(grads, norm_type))


def _multiply_(
    key: GroupKey,
    grads: list[torch.Tensor],
    factor: torch.Tensor,
    non_finite: torch.Tensor,
    found_inf_per_device: dict[torch.device, torch.Tensor],
    check_output: bool,
) -> None:
    device, dtype = key
    found = found_inf_on(found_inf_per_device, device)
    if caps(device).amp_kernels and dtype == torch.float32:
        # Flags non-finite *inputs* (the scaled grads), like torch's unscale_.
        factor32 = factor.to(device=device, dtype=torch.float32)
        torch_compat.amp_unscale_and_check_(grads, found, factor32)
        if not check_output:
            return
    else:
        torch_compat.foreach_mul_(grads, factor.to(device))
    torch.maximum(found, non_finite.to(device), out=found)


def clamp_(plan: GradPlan, clip_value: float) -> None:
    """Clamp the (unscaled) grads of ``plan`` to ``[-clip_value, clip_value]`` in place.

    Host sync: none.
    """
    value = float(clip_value)
    with torch.no_grad():
        for (device, _dtype), grads in plan.kernel_groups().items():
            big = sum(g.numel() for g in grads) > _BIG * len(grads)
            if caps(device).per_tensor_clamp and big:
                for grad in grads:
                    grad.clamp_(-value, value)
            else:
                torch_compat.foreach_clamp_min_(grads, -value)
                torch_compat.foreach_clamp_max_(grads, value)
