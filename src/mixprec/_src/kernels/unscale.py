"""Unscale + non-finite check: one pass per (device, dtype) group where the device has a kernel.

Implementation choice per device type (the measurements behind it: ``docs/performance.md``):

* CPU and CUDA: ``torch._amp_foreach_non_finite_check_and_unscale_``, the fused kernel torch uses
  (one read and one write of each grad; multi-tensor-apply on CUDA). On the CPU it is about as
  fast as a plain ``_foreach_mul_`` on big tensors and faster on many small ones, so it is also
  what :mod:`mixprec._src.kernels.clip` multiplies with; a compiled (inductor) multiply-and-check
  makes two passes. It tests each *input* value, so it misses an overflow produced by the multiply
  itself, which is only possible when the scale is below 1 (``1/scale > 1``). In that case, and
  only then, a second, checking pass runs over the unscaled values (``check_output=True``).
* Other devices: ``torch._foreach_mul_`` then an ``isfinite`` reduction of the *outputs*, which
  catches both kinds of overflow.
* Which devices have the fused kernel is a column of :mod:`mixprec._src.devices`
  (``amp_kernels``).
* Every device: a group whose grads tile contiguous ranges (see :mod:`mixprec._src.kernels.flat`) is
  passed as those ranges, which removes the per-tensor cost.
"""

from __future__ import annotations

import torch

from mixprec._src import torch_compat
from mixprec._src.devices import caps
from mixprec._src.kernels.plan import GradPlan


def _gather(plan: GradPlan) -> dict[tuple[torch.device, torch.dtype], list]:
    """Dense groups plus the values of sparse grads (fp16 ones coalesced first, as torch does).

    Coalescing sums duplicate indices, which can overflow in fp16, so it must happen before the
    check. It replaces ``param.grad`` (out of place), exactly like torch.
    """
    if not plan.sparse:
        return plan.kernel_groups()
    groups = {key: list(grads) for key, grads in plan.kernel_groups().items()}
    for ref in plan.sparse:
        grad = ref.param.grad
        assert grad is not None
        if grad.dtype == torch.float16:
            ref.param.grad = grad = grad.coalesce()
        groups.setdefault((grad.device, grad.dtype), []).append(torch_compat.sparse_values(grad))
    return groups


def unscale_grads_(
    plan: GradPlan,
    inv_scale: torch.Tensor,
    found_inf_per_device: dict[torch.device, torch.Tensor],
    *,
    check_output: bool,
) -> None:
    """Multiply every grad of ``plan`` by ``inv_scale`` in place and record non-finite values.

    Args:
        plan: the grads, grouped.
        inv_scale: 0-d float32 tensor, ``1 / scale``.
        found_inf_per_device: filled with one 0-d float32 tensor per device (created at zero when
            absent); any non-finite value makes it non-zero.
        check_output: also detect overflow created by the multiply (needed when ``inv_scale > 1``).

    Host sync: none.
    """
    groups = _gather(plan)
    with torch.no_grad():  # grads with a graph (create_graph=True): do not record the unscale
        _unscale_groups_(groups, inv_scale, found_inf_per_device, check_output)


def _unscale_groups_(
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]],
    inv_scale: torch.Tensor,
    found_inf_per_device: dict[torch.device, torch.Tensor],
    check_output: bool,
) -> None:
    inv_by_device: dict[torch.device, torch.Tensor] = {}
    for (device, _dtype), grads in groups.items():
        found = found_inf_on(found_inf_per_device, device)
        inv = inv_by_device.get(device)
        if inv is None:
            same = inv_scale.device == device
            inv = inv_scale if same else inv_scale.to(device, non_blocking=True)
            inv_by_device[device] = inv
        if caps(device).amp_kernels:
            torch_compat.amp_unscale_and_check_(grads, found, inv)
            if check_output:
                _any_non_finite_(grads, found)
        else:
            torch_compat.foreach_mul_(grads, inv)
            _any_non_finite_(grads, found)


def check_finite_(plan: GradPlan, found_inf_per_device: dict[torch.device, torch.Tensor]) -> None:
    """Record non-finite grads without changing them (the fused-optimizer path).

    Host sync: none.
    """
    with torch.no_grad():
        for (device, _dtype), grads in _gather(plan).items():
            _any_non_finite_(grads, found_inf_on(found_inf_per_device, device))


def found_inf_on(
    found_inf_per_device: dict[torch.device, torch.Tensor], device: torch.device
) -> torch.Tensor:
    """The device's 0-d float32 overflow flag, created at zero when absent. Host sync: none."""
    found = found_inf_per_device.get(device)
    if found is None:
        found = found_inf_per_device[device] = torch.zeros((), dtype=torch.float32, device=device)
    return found


_ONE: dict[torch.device, torch.Tensor] = {}


def _any_non_finite_(grads: list[torch.Tensor], found: torch.Tensor) -> None:
    """``found = max(found, any non-finite value in grads)`` with a read-only pass."""
    if not grads:
        return
    if caps(grads[0].device).amp_kernels:
        # inv_scale == 1 makes the fused kernel a pure check (values are left as they are).
        one = _ONE.get(found.device)  # (a constant: not created at every check)
        if one is None:
            one = _ONE[found.device] = torch.ones((), dtype=torch.float32, device=found.device)
        torch_compat.amp_unscale_and_check_(grads, found, one)
        return
    flags = torch.stack([torch.logical_not(torch.isfinite(g)).any() for g in grads])
    found.copy_(torch.maximum(found, flags.any().to(found.dtype)))
