"""GradScaler's clipping methods: unscale fused with clipping (the arithmetic is in
``kernels.clip``).

``clip_grad_norm_`` and ``clip_grad_value_`` are methods of the one
:class:`~mixprec.GradScaler` class, defined here and bound into it by name; they reach the
scaler only through its internal interface (:func:`~mixprec._src.scaling.engine.engine_of`).

Both count as the optimizer's ``unscale_`` for this iteration (the phase table moves it to
UNSCALED), so the usual rules apply: once per optimizer per iteration, before ``step``. A deferred
norm clip (``in_step=True``) measures the norm now and leaves the multiply to the step: a fused
optimizer gets the coefficient folded into its ``grad_scale``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from mixprec._src.kernels import clip
from mixprec._src.kernels.plan import GradPlan, group_grads, plan_grads
from mixprec._src.scaling import diagnostics
from mixprec._src.scaling.engine import Engine, engine_of
from mixprec._src.scaling.phases import OptimizerRecord
from mixprec.errors import ConfigError, LowPrecisionGradError

if TYPE_CHECKING:
    from mixprec._src.scaling.grad_scaler import GradScaler

_Optimizer = torch.optim.Optimizer


def clip_grad_norm_(
    self: GradScaler,
    optimizer: _Optimizer,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    parameters: Iterable[torch.Tensor] | None = None,
    in_step: bool = False,
) -> torch.Tensor:
    """Unscale the optimizer's gradients and clip their total norm, in two passes.

    Does what ``scaler.unscale_(optimizer)`` then ``torch.nn.utils.clip_grad_norm_(params,
    max_norm, norm_type)`` does, with a pass fewer; it counts as this iteration's
    ``unscale_``. When a gradient is inf/NaN the norm is inf/NaN and the next ``step``
    skips. The result is bit-identical to torch's sequence when the scale is a power of two
    (the default), ``norm_type`` is 1, 2 or inf and the norm is summed in the same order:
    torch sums in the order of ``params``, mixprec in the optimizer's, unless
    ``parameters`` gives the order (``docs/clipping.md`` lists the cases). With a
    ``process_group`` or DTensor grads the norm is the global one (one all-reduce).

    Args:
        optimizer: the optimizer whose gradients are unscaled and clipped.
        max_norm: the largest total norm kept, a number >= 0.
        norm_type: ``p`` of the p-norm, > 0, or ``float('inf')``.
        error_if_nonfinite: raise when the norm is inf/NaN, as torch does (one host sync).
        parameters: the parameters in the order ``torch.nn.utils.clip_grad_norm_`` would get
            them (e.g. ``model.parameters()``); their grads must be the optimizer's.
        in_step: clip inside the next ``step(optimizer)`` instead of now: the norm is
            measured now (one read), and a fused optimizer gets the clip coefficient folded
            into its ``grad_scale``, so the gradients are not multiplied separately. Until
            that step ``.grad`` holds the scaled, unclipped gradients.

    Returns:
        The total norm of the unscaled gradients before clipping (0-d tensor on the
        gradients' device).

    Raises:
        ScalerStateError: no ``scale()`` yet, or already unscaled, clipped or stepped.
        LowPrecisionGradError: some gradients are fp16 (names them; nothing is changed).
        ConfigError: a bad ``max_norm``/``norm_type``/``parameters``, or sparse gradients.
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
    if not self.is_enabled():
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    return _clip_norm(
        engine_of(self), optimizer, max_norm, norm_type, error_if_nonfinite, parameters, in_step
    )


def clip_grad_value_(self: GradScaler, optimizer: _Optimizer, clip_value: float) -> None:
    """Unscale the optimizer's gradients and clamp them to ``[-clip_value, clip_value]``.

    Does what ``scaler.unscale_(optimizer)`` then ``torch.nn.utils.clip_grad_value_(params,
    clip_value)`` does (bit-identical), in one call that counts as this iteration's
    ``unscale_``. Overflow is detected before the clamp, so the next ``step`` still skips.

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
    if not self.is_enabled():
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_value_(params, clip_value)
        return
    _clip_value(engine_of(self), optimizer, clip_value)


def _clip_norm(
    engine: Engine,
    optimizer: _Optimizer,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    parameters: Iterable[torch.Tensor] | None,
    in_step: bool,
) -> torch.Tensor:
    """:func:`clip_grad_norm_` on an engine. Host sync: as documented there."""
    norm_type = clip.validate_norm_type(norm_type)
    limit = validated_limit(max_norm, "max_norm")
    record, plan, (flags, sharded) = _plan_for_clip(engine, optimizer, "clip_grad_norm_")
    order = None if parameters is None else _norm_order(optimizer, parameters, engine)
    reduce = None  # sharded grads: the global norm, one all-reduce (mixprec._src.dist)
    if sharded is not None:
        reduce = functools.partial(engine.dist.reduce_norm_, norm_type=norm_type, group=sharded)
    inv = engine.state.inv_scale()
    total, coefficient = clip.clip_grad_norm_(
        plan,
        inv,
        record.found_inf_per_device,
        limit,
        norm_type,
        check_output=engine.state.may_be_below_one,
        error_if_nonfinite=error_if_nonfinite,
        reduce_norm=reduce,
        norm_groups=order,
        defer=in_step,
    )
    if flags is not None and sharded is None:  # replicated grads under Join: flags only
        engine.dist.agree_(record.found_inf_per_device, flags, inv.device)
    engine.phases.mark_unscaled(record, optimizer, plan.missing, coefficient if in_step else None)
    return total


def _clip_value(engine: Engine, optimizer: _Optimizer, clip_value: float) -> None:
    """:func:`clip_grad_value_` on an engine. Host sync: none."""
    limit = validated_limit(clip_value, "clip_value")
    record, plan, (group, _) = _plan_for_clip(engine, optimizer, "clip_grad_value_")
    inv = engine.state.inv_scale()
    clip.clip_grad_value_(
        plan,
        inv,
        record.found_inf_per_device,
        limit,
        check_output=engine.state.may_be_below_one,
    )
    if group is not None:  # one all-reduce of the flag (mixprec._src.dist)
        engine.dist.agree_(record.found_inf_per_device, group, inv.device)
    engine.phases.mark_unscaled(record, optimizer, plan.missing)


def _plan_for_clip(
    engine: Engine, optimizer: _Optimizer, what: str
) -> tuple[OptimizerRecord, GradPlan, tuple[Any, Any]]:
    """The record, the plan (DTensor grads as local shards) and the groups that agree on the
    flag and that the grads are sharded over (mixprec._src.dist)."""
    engine.require_scale(what)
    record = engine.phases.begin_unscale(optimizer, what)
    plan, flags, sharded = engine.dist.prepare_clip(plan_grads(optimizer))
    if plan.low_precision:
        raise LowPrecisionGradError(diagnostics.low_precision_message(plan.low_precision))
    clip.validate_plan(plan, what)
    return record, plan, (flags, sharded)


def _norm_order(
    optimizer: _Optimizer, parameters: Iterable[torch.Tensor], engine: Engine
) -> dict[Any, list[torch.Tensor]]:
    """The grads grouped as ``torch.nn.utils.clip_grad_norm_(parameters)`` groups them, after
    checking they are exactly the optimizer's."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    listed = group_grads(parameters)
    ours = {id(g) for g in plan_grads(optimizer).all_grads()}
    theirs = {id(g) for grads in listed.values() for g in grads}
    if ours != theirs:
        raise ConfigError(
            "clip_grad_norm_(..., parameters=...) must list exactly the parameters whose "
            f"gradients the optimizer holds ({len(ours)} with a grad); of the {len(theirs)} "
            f"gradients given, {len(theirs - ours)} are not the optimizer's, and "
            f"{len(ours - theirs)} of the optimizer's are missing. Pass the parameters the "
            "optimizer was built from (e.g. model.parameters()), or leave parameters out."
        )
    local, _, _ = engine.dist.prepare_clip(GradPlan(dense=listed))
    return local.dense


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
