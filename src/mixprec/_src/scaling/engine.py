"""How a pass over an optimizer's gradients runs, and the internal interface built on it.

:class:`Engine` joins the GradScaler's parts for the work on gradients: it takes the scale from
:class:`~mixprec._src.scaling.state.ScaleState`, moves phases through
:class:`~mixprec._src.scaling.phases.PhaseTable`, agrees with other ranks through
:class:`~mixprec._src.dist.state.DistState`, records skips in
:class:`~mixprec._src.scaling.telemetry.Telemetry`, and runs the kernels of
:mod:`mixprec._src.kernels`. It holds no state of its own.

It is also the small internal interface that the code stepping with a scaler uses instead of the
scaler's private attributes (:func:`engine_of`): closures (:mod:`.closure`), clipping
(:mod:`.clipping`) and ``JoinableScaler`` (:mod:`.join`) call only the methods below.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mixprec._src import optim
from mixprec._src.dist.state import DistState
from mixprec._src.kernels import clip
from mixprec._src.kernels.plan import GradPlan, plan_grads
from mixprec._src.kernels.unscale import check_finite_, unscale_grads_
from mixprec._src.scaling import diagnostics
from mixprec._src.scaling.phases import OptimizerRecord, OptState, PhaseTable
from mixprec._src.scaling.state import ScaleState
from mixprec._src.scaling.telemetry import Telemetry
from mixprec.errors import ConfigError, LowPrecisionGradError

_Optimizer = torch.optim.Optimizer


class Engine:
    """The passes over gradients, on the parts of one GradScaler.

    Attributes:
        state: where the scale is.
        phases: where a phase changes.
        telemetry: skip flags, history, hooks.
        dist: found-inf agreement and its bookkeeping.
    """

    def __init__(
        self, state: ScaleState, phases: PhaseTable, telemetry: Telemetry, dist: DistState
    ) -> None:
        self.state = state
        self.phases = phases
        self.telemetry = telemetry
        self.dist = dist

    # ------------------------------------------------------------------ scale

    def require_scale(self, method: str) -> torch.Tensor:
        """The scale tensor, after checking that ``scale()`` created it. Host sync: none."""
        scale = self.state.scale
        self.phases.require_scale(scale is not None, method)
        assert scale is not None
        return scale

    def unscale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` divided by the scale (what the optimizer of a closure step sees).

        Host sync: none.
        """
        return loss / self.state.scale_on(loss.device)

    @contextmanager
    def recording(self) -> Iterator[list[Any]]:
        """What ``scale()`` returns inside the block. Host sync: none."""
        with self.phases.recording() as outputs:
            yield outputs

    # ------------------------------------------------------------------ passes

    def unscale(
        self, optimizer: _Optimizer, record: OptimizerRecord, for_step: bool = False
    ) -> GradPlan:
        """Unscale and check the optimizer's grads in place; the record becomes UNSCALED.

        ``for_step``: ``step``'s implicit unscale. Without any grad nothing was done then, and
        the optimizer stays READY, so that a retry after ``backward()`` unscales.

        Raises:
            LowPrecisionGradError: some gradients are fp16 (names them; nothing is changed).

        Host sync: none.
        """
        plan, group, agree = self.dist.prepare(plan_grads(optimizer))
        if plan.low_precision:
            raise LowPrecisionGradError(diagnostics.low_precision_message(plan.low_precision))
        inv = self.state.inv_scale()
        unscale_grads_(
            plan, inv, record.found_inf_per_device, check_output=self.state.may_be_below_one
        )
        if agree:  # one all-reduce per optimizer per iteration (mixprec._src.dist)
            self.dist.agree_(record.found_inf_per_device, group, inv.device)
        self.phases.mark_unscaled(record, optimizer, plan.missing)
        if for_step and not record.found_inf_per_device:
            self.phases.reopen(record)
        return plan

    def check(self, optimizer: _Optimizer, record: OptimizerRecord) -> None:
        """Check the grads for inf/NaN without changing them (the fused path). Host sync: none."""
        plan, group, agree = self.dist.prepare(plan_grads(optimizer))
        check_finite_(plan, record.found_inf_per_device)
        self.phases.mark_checked(record, optimizer, plan.missing)
        if agree:
            self.dist.agree_(record.found_inf_per_device, group, self.require_scale("step").device)

    def found_inf(self, record: OptimizerRecord, optimizer: _Optimizer) -> torch.Tensor:
        """The record's flags combined on the scale's device (non-zero: overflow).

        Raises:
            MissingGradError: nothing was checked (names the parameters without a grad).

        Host sync: none.
        """
        flags = record.found_inf_per_device
        if not flags:
            self.phases.require_checked(record, optimizer)  # raises
        scale = self.state.scale
        assert scale is not None  # (flags exist only once scale() created the scale)
        return sum_on(list(flags.values()), scale.device)

    def overflowed(self, record: OptimizerRecord, optimizer: _Optimizer) -> bool:
        """Whether the record's grads overflowed. Host sync: one."""
        return bool(self.found_inf(record, optimizer).item() != 0)

    def apply_deferred(self, optimizer: _Optimizer, record: OptimizerRecord) -> None:
        """Multiply the grads by a deferred clip coefficient and ``1/scale`` (a non-fused step
        after ``clip_grad_norm_(..., in_step=True)``). Host sync: none."""
        if record.deferred is None:
            return
        plan, _, _ = self.dist.prepare_clip(plan_grads(optimizer))
        factor = record.deferred * self.state.inv_scale().to(record.deferred.device)
        clip.multiply_(plan, factor, record.found_inf_per_device)
        self.phases.mark_unscaled(record, optimizer, plan.missing)

    # ------------------------------------------------------------------ steps

    def step_plain(
        self, optimizer: _Optimizer, record: OptimizerRecord, args: tuple, kwargs: dict
    ) -> Any:
        """Unscale if needed, read the flag (one host sync) and step unless it overflowed."""
        if record.stage is OptState.READY:
            self.unscale(optimizer, record, for_step=True)
        elif record.deferred is not None:
            self.apply_deferred(optimizer, record)
        found_inf = self.found_inf(record, optimizer)
        self.telemetry.note_step(optimizer, found_inf)
        skipped = bool(found_inf.item() != 0)
        self.phases.mark_stepped(record, optimizer, skipped)  # before: a retry is refused
        return None if skipped else optimizer.step(*args, **kwargs)

    def step_fused(
        self, optimizer: _Optimizer, record: OptimizerRecord, args: tuple, kwargs: dict
    ) -> Any:
        """Hand ``grad_scale``/``found_inf`` to an optimizer that skips inside its kernel.

        Host sync: none, except on the optimizer's first step (see
        :func:`mixprec._src.optim.needs_first_step_read`).
        """
        if record.stage is OptState.READY and self.state.may_be_below_one:
            self.unscale(optimizer, record, for_step=True)  # the kernel's division could overflow
        if record.stage is OptState.READY:
            self.check(optimizer, record)
        found_inf = self.found_inf(record, optimizer)
        grad_scale = self._grad_scale(optimizer, record)
        self.telemetry.note_step(optimizer, found_inf)
        skipped = None
        if optim.needs_first_step_read(optimizer):  # the state is created by this step
            skipped = bool(found_inf.item() != 0)
        self.phases.mark_stepped(record, optimizer, skipped)
        if skipped:
            return None
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        optim.mark_stepped(optimizer)
        return result

    def _grad_scale(self, optimizer: _Optimizer, record: OptimizerRecord) -> Any:
        """What the fused kernel divides the grads by (torch's rule, plus a deferred clip)."""
        user = getattr(optimizer, "grad_scale", None)
        if record.stage is OptState.UNSCALED and record.deferred is None:
            return user  # already unscaled (and clipped): the kernel must not divide again
        scale = self.require_scale("step")
        if record.deferred is not None:
            coefficient = record.deferred.to(device=scale.device, dtype=torch.float32)
            scale = scale / coefficient  # grads / (scale / c) = unscaled grads * c
        return scale if user is None else scale * user

    def step_legacy(
        self, optimizer: _Optimizer, record: OptimizerRecord, args: tuple, kwargs: dict, scaler: Any
    ) -> Any:
        """torch's legacy fused contract: ``step(..., grad_scaler=scaler)``; the optimizer calls
        ``scaler._check_inf_per_device(self)`` and unscales itself. Host sync: the optimizer's."""
        result = optimizer.step(*args, **{**kwargs, "grad_scaler": scaler})
        self.phases.mark_stepped(record, optimizer, None)
        if record.found_inf_per_device:
            self.telemetry.note_step(optimizer, self.found_inf(record, optimizer))
        return result

    def finish_step(self, optimizer: _Optimizer, record: OptimizerRecord, skipped: bool) -> None:
        """A closure step ended (taken or skipped). Host sync: none."""
        self.telemetry.note_step(optimizer, self.found_inf(record, optimizer))
        self.phases.mark_stepped(record, optimizer, skipped)

    # ------------------------------------------------------------------ Join

    def join(self, joinable: Any, group: Any) -> None:
        """Take part in ``torch.distributed.algorithms.Join`` over ``group``. Host sync: none."""
        self.dist.join(joinable, group)

    def shadow_iteration(self, keys: list[object], flags: list[torch.Tensor], kinds: list) -> None:
        """Record a joined rank's shadow iteration: one agreed flag per collective of the last
        real iteration (then call the scaler's ``update()``). Host sync: one per flag."""
        for key, flag in zip(keys, flags, strict=False):
            self.phases.shadow(key, flag)
        self.dist.issued = list(kinds)


def sum_on(found_infs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Overflow flags from several devices combined on ``device`` (non-zero: overflow).

    Host sync: none.
    """
    total = found_infs[0]
    if len(found_infs) == 1 and total.device == device:
        return total  # the common case, without a copy
    total = total.to(device, non_blocking=True)
    for other in found_infs[1:]:
        total = total + other.to(device, non_blocking=True)
    return total


def engine_of(scaler: Any) -> Engine:
    """The internal interface of a mixprec GradScaler.

    Raises:
        ConfigError: ``scaler`` is not a mixprec GradScaler (e.g. a ``torch.amp.GradScaler``).

    Host sync: none.
    """
    engine = getattr(scaler, "_engine", None)
    if not isinstance(engine, Engine):
        raise ConfigError(
            f"Expected a mixprec.GradScaler, got {type(scaler).__name__}. Build the scaler with "
            "mixprec.GradScaler(...) (it takes torch.amp.GradScaler's arguments)."
        )
    return engine
