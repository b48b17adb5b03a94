"""GradScaler's clipping methods: unscale fused with clipping (the arithmetic is in kernels.clip).

A mixin of :class:`~mixprec.GradScaler`, kept in its own module so the shell stays short. Both
methods count as the optimizer's ``unscale_`` for this iteration (the phase table moves it to
UNSCALED), so the usual rules apply: once per optimizer per iteration, before ``step``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from mixprec._src.kernels import clip
from mixprec._src.kernels.plan import GradPlan, plan_grads
from mixprec._src.scaling import diagnostics
from mixprec._src.scaling.core import ScalerCore
from mixprec._src.scaling.phases import OptimizerRecord
from mixprec.errors import ConfigError, LowPrecisionGradError, ScalerStateError

_Optimizer = torch.optim.Optimizer


class ClippingMixin(ScalerCore):
    """``clip_grad_norm_`` and ``clip_grad_value_`` of :class:`~mixprec.GradScaler`."""

    def clip_grad_norm_(
        self,
        optimizer: _Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Unscale the optimizer's gradients and clip their total norm, in two passes.

        Does what ``scaler.unscale_(optimizer)`` followed by
        ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)`` does (same norm and
        grads to float32 rounding; bit-identical when the scale is a power of two, as it is by
        default) with one pass over the gradients fewer, and cannot clip *scaled* gradients by
        mistake. It counts as this iteration's ``unscale_`` for ``optimizer``. When a gradient
        is inf/NaN the returned norm is inf/NaN and the next ``step`` skips (no error). The norm
        is computed over the optimizer's own parameters only; the flat fast path applies to
        grads laid out by :func:`mixprec.flatten_grads` or DDP bucket views. With a
        ``process_group`` (the group the grads are sharded over) or DTensor grads, the norm is the
        global one over every rank's shards, combined with one all-reduce that also serves as the
        ranks' overflow agreement. DDP's replicated grads need no group: their norm is local.

        Args:
            optimizer: the optimizer whose gradients are unscaled and clipped.
            max_norm: the largest total norm kept, a number >= 0.
            norm_type: ``p`` of the p-norm, > 0, or ``float('inf')``.
            error_if_nonfinite: raise when the norm is inf/NaN, as torch does (costs one host
                sync to read the norm). Nothing is changed when it raises.

        Returns:
            The total norm of the unscaled gradients before clipping (0-d tensor on the
            gradients' device; no host sync).

        Raises:
            ScalerStateError: no ``scale()`` yet, or the optimizer was already unscaled, clipped
                or stepped since the last ``update()``.
            LowPrecisionGradError: some gradients are fp16 (names them; nothing is changed).
            ConfigError: a bad ``max_norm``/``norm_type``, or sparse gradients.
            NonFiniteNormError: ``error_if_nonfinite=True`` and the norm is inf/NaN.

        Example:
            >>> import torch, mixprec
            >>> model = torch.nn.Linear(4, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = mixprec.GradScaler()
            >>> scaler.scale(model(torch.ones(2, 4)).sum()).backward()
            >>> norm = scaler.clip_grad_norm_(opt, max_norm=1.0)
            >>> bool(torch.linalg.vector_norm(model.weight.grad) <= 1.0)
            True
            >>> scaler.step(opt)
            >>> scaler.update()

        Host sync: none; one with ``error_if_nonfinite=True``.
        """
        if not self._enabled:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        norm_type = clip.validate_norm_type(norm_type)
        limit = _validated_limit(max_norm, "max_norm")
        record, plan, (flags, sharded) = self._plan_for_clip(optimizer, "clip_grad_norm_")
        reduce = None  # sharded grads: the global norm, one all-reduce (mixprec._src.dist)
        if sharded is not None:
            reduce = functools.partial(self._dist.reduce_norm_, norm_type=norm_type, group=sharded)
        total = clip.clip_grad_norm_(
            plan,
            self._get_inv_scale(),
            record.found_inf_per_device,
            limit,
            norm_type,
            check_output=self._mirror.scale_may_be_below_one,
            error_if_nonfinite=error_if_nonfinite,
            reduce_norm=reduce,
        )
        if flags is not None and sharded is None:  # replicated grads under Join: flags only
            self._dist.agree_(record.found_inf_per_device, flags, self._get_inv_scale().device)
        record.mark_unscaled(optimizer, plan.missing)
        return total

    def clip_grad_value_(self, optimizer: _Optimizer, clip_value: float) -> None:
        """Unscale the optimizer's gradients and clamp them to ``[-clip_value, clip_value]``.

        Does what ``scaler.unscale_(optimizer)`` followed by
        ``torch.nn.utils.clip_grad_value_(params, clip_value)`` does (bit-identical), in one
        call that counts as this iteration's ``unscale_``. Overflow is detected before the clamp
        (which would turn inf into ``clip_value``), so the next ``step`` still skips.

        Args:
            optimizer: the optimizer whose gradients are unscaled and clamped.
            clip_value: a number >= 0.

        Raises:
            ScalerStateError: as :meth:`clip_grad_norm_`.
            LowPrecisionGradError: some gradients are fp16 (nothing is changed).
            ConfigError: a bad ``clip_value``, or sparse gradients.

        Example:
            >>> import torch, mixprec
            >>> model = torch.nn.Linear(4, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = mixprec.GradScaler()
            >>> scaler.scale(model(torch.ones(2, 4)).sum()).backward()
            >>> scaler.clip_grad_value_(opt, 0.5)
            >>> float(model.bias.grad.abs().max())
            0.5

        Host sync: none.
        """
        if not self._enabled:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_value_(params, clip_value)
            return
        limit = _validated_limit(clip_value, "clip_value")
        record, plan, (group, _) = self._plan_for_clip(optimizer, "clip_grad_value_")
        clip.clip_grad_value_(
            plan,
            self._get_inv_scale(),
            record.found_inf_per_device,
            limit,
            check_output=self._mirror.scale_may_be_below_one,
        )
        if group is not None:  # one all-reduce of the flag (mixprec._src.dist)
            self._dist.agree_(record.found_inf_per_device, group, self._get_inv_scale().device)
        record.mark_unscaled(optimizer, plan.missing)

    def _plan_for_clip(
        self, optimizer: _Optimizer, what: str
    ) -> tuple[OptimizerRecord, GradPlan, tuple[Any, Any]]:
        """The record, the plan (DTensor grads as local shards) and the groups that agree on the
        flag and that the grads are sharded over (mixprec._src.dist)."""
        self._require_state(what)
        try:
            record = self._phases.check_can_unscale(optimizer)
        except ScalerStateError as exc:
            raise ScalerStateError(f"{what}() unscales the gradients, so: {exc}") from None
        plan, flags, sharded = self._dist.prepare_clip(plan_grads(optimizer))
        if plan.low_precision:
            raise LowPrecisionGradError(diagnostics.low_precision_message(plan.low_precision))
        clip.validate_plan(plan, what)
        return record, plan, (flags, sharded)


def _validated_limit(value: float, name: str) -> float:
    try:
        limit = float(value)
    except (TypeError, ValueError):
        limit = math.nan
    if not limit >= 0:
        raise ConfigError(f"{name} must be a number >= 0 (inf allowed), got {value!r}.")
    return limit
