"""GradScaler: a thin shell that sequences the iteration and delegates the arithmetic.

The pure parts live beside it: the settings (``config``), the update rule (``rule``), the phases of
each optimizer (``phases``), the host's view of the scale (``telemetry``), state-dict validation
(``state``), the messages (``diagnostics``) and the passes over gradients (``kernels``).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from mixprec._src.kernels.plan import GradPlan, plan_grads
from mixprec._src.kernels.unscale import check_finite_, unscale_grads_
from mixprec._src.scaling import diagnostics
from mixprec._src.scaling.args import SIGNATURE
from mixprec._src.scaling.checks import (
    has_uninitialised_state,
    takes_grad_scaler,
    validated_new_scale,
)
from mixprec._src.scaling.clipping import ClippingMixin
from mixprec._src.scaling.closure import split_closure, step_with_closure
from mixprec._src.scaling.phases import OptimizerRecord, OptState
from mixprec._src.scaling.rule import ScaleState, to_f32, update_scale_, write_host_update_
from mixprec._src.scaling.signals import ScalerSignals
from mixprec._src.scaling.telemetry import (
    UpdateEvent,
)
from mixprec.errors import (
    ConfigError,
    LowPrecisionGradError,
    MissingGradError,
    ScalerStateError,
)

_Optimizer = torch.optim.Optimizer


def _sum_on(found_infs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Overflow flags from several devices combined on ``device`` (non-zero: overflow)."""
    total = found_infs[0].to(device, non_blocking=True)
    for other in found_infs[1:]:
        total = total + other.to(device, non_blocking=True)
    return total


class GradScaler(ClippingMixin, ScalerSignals):
    """Dynamic loss scaling, a drop-in for ``torch.amp.GradScaler`` on every device.

    Both call forms work: torch 2's ``GradScaler("cuda", init_scale, growth_factor,
    backoff_factor, growth_interval, enabled)`` and torch.cuda.amp 1.5's
    ``GradScaler(init_scale, growth_factor, backoff_factor, growth_interval, enabled)``. The scale
    lives on the device of the first tensor passed to :meth:`scale`, whatever ``device`` says, so
    a scaler never disables itself: ``GradScaler("cuda")`` on a machine without CUDA scales the
    CPU tensors it is given, for real. With default settings the scale trajectory, the skipped
    steps and the parameters are bit-identical to torch's.

    Args:
        device: accepted for compatibility; where the scale lives is decided by the outputs.
        init_scale: first scale, in (0, float32 max].
        growth_factor: multiplier after ``growth_interval`` clean iterations, > 1.
        backoff_factor: multiplier after an overflowing iteration, in (0, 1).
        growth_interval: clean iterations before a growth, an int >= 1.
        enabled: ``False`` makes every method a pass-through (``step`` just steps).
        min_scale: keyword-only lower bound (default: the smallest normal float32, never 0).
        max_scale: keyword-only upper bound (default: none; growth never reaches inf).
        hysteresis: keyword-only; back off only on the N-th consecutive overflowing iteration.
        max_consecutive_skips: keyword-only; raise
            :class:`~mixprec.errors.ScaleCollapseError` on the N-th consecutive skipped iteration.
        process_group: keyword-only ``torch.distributed`` group the grads are sharded over
            (FSDP1, ZeRO, tensor parallel): its ranks agree on every skip with one MAX
            all-reduce of the found-inf flag per optimizer per iteration, and
            ``clip_grad_norm_`` sums norms over it. Not for DDP (replicated grads); detected
            for DTensor (FSDP2) grads. Not saved in state dicts or pickles. See
            ``docs/distributed.md``.

    Example:
        >>> import torch, mixprec
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = mixprec.GradScaler()
        >>> loss = model(torch.randn(8, 4)).pow(2).mean()
        >>> scaler.scale(loss).backward()
        >>> scaler.step(opt)
        >>> scaler.update()
        >>> scaler.get_scale()
        65536.0
    """

    __signature__ = SIGNATURE

    # ------------------------------------------------------------------ scale

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or a nested list/tuple/dict/iterable of tensors, by the scale.

        Lists, tuples (named ones too) and dicts keep their type; other iterables come back as a
        list. The scale is created on the device of the first tensor met; outputs on other
        devices are multiplied by a copy on their own device. As in torch, a 0-d fp16 loss
        becomes fp32 (type promotion with the fp32 scale).

        Raises:
            ConfigError: a leaf is not a tensor (numbers, strings and ``None`` are rejected).

        Host sync: none.
        """
        if not self._enabled:
            return outputs
        return self._scale_nested(outputs)

    def _scale_nested(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value * self._scale_on(value.device)
        if isinstance(value, Mapping):
            return type(value)({k: self._scale_nested(v) for k, v in value.items()})  # type: ignore[call-arg]
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise ConfigError(
                "outputs must be a Tensor or an iterable of Tensors; found a "
                f"{type(value).__name__} ({value!r:.60}). Scale the loss tensor itself, e.g. "
                "scaler.scale(loss).backward()."
            )
        scaled = [self._scale_nested(v) for v in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*scaled)
        if isinstance(value, (list, tuple)):
            return type(value)(scaled)
        return scaled

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        cached = self._per_device_cache.get(device)
        if cached is None:
            state = self._lazy_init(device)
            cached = state.scale.to(device, non_blocking=True)
            self._per_device_cache[device] = cached
        return cached

    # ------------------------------------------------------------------ unscale

    def unscale_(self, optimizer: _Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and check them for inf/NaN.

        Call it between ``backward`` and ``step`` when the gradients must be read or changed
        unscaled (clipping); ``step`` does it otherwise. Call it at most once per optimizer per
        iteration. Overflow created by the division itself (possible when the scale is below
        1) is detected too, which torch misses.

        Raises:
            ScalerStateError: no ``scale()`` yet, or already unscaled/stepped this iteration.
            LowPrecisionGradError: some gradients are fp16 (names them; nothing is changed).

        Host sync: none.
        """
        if not self._enabled:
            return
        self._require_state("unscale_")
        record = self._phases.check_can_unscale(optimizer)
        self._unscale_into(optimizer, record)

    def _unscale_into(self, optimizer: _Optimizer, record: OptimizerRecord) -> GradPlan:
        plan, group, agree = self._dist.prepare(plan_grads(optimizer))
        if plan.low_precision:
            raise LowPrecisionGradError(diagnostics.low_precision_message(plan.low_precision))
        unscale_grads_(
            plan,
            self._get_inv_scale(),
            record.found_inf_per_device,
            check_output=self._mirror.scale_may_be_below_one,
        )
        if agree:  # one all-reduce per optimizer per iteration (mixprec._src.dist)
            self._dist.agree_(record.found_inf_per_device, group, self._get_inv_scale().device)
        record.mark_unscaled(optimizer, plan.missing)
        return plan

    def _unscale_for_step(self, optimizer: _Optimizer, record: OptimizerRecord) -> None:
        """``step``'s implicit unscale. Without any grad nothing was done: the optimizer stays
        READY, so that a retry after ``backward()`` unscales."""
        self._unscale_into(optimizer, record)
        if not record.found_inf_per_device:
            record.stage = OptState.READY

    # ------------------------------------------------------------------ step

    def step(self, optimizer: _Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` already did) and step, unless a grad is inf/NaN.

        Returns ``optimizer.step(*args, **kwargs)``'s value, or ``None`` when the step was
        skipped. A skipped step leaves the parameters and the optimizer's state exactly as they
        were. Optimizers that declare ``_step_supports_amp_scaling`` (torch's ``fused=True``
        ones) get ``grad_scale``/``found_inf`` and skip inside their kernel, as with torch; on
        their first step (state not yet created), mixprec reads the overflow flag once so that a
        skipped first step does not leave half-created state (torch's fused SGD keeps an
        uninitialised momentum buffer there).

        A closure (``step(optimizer, closure)`` or ``closure=``), which must run
        ``scaler.scale(loss).backward()``, may be evaluated several times (LBFGS, SAM): each
        evaluation's gradients are unscaled and checked, the optimizer gets the unscaled loss,
        and an overflow in any evaluation skips the step and restores the parameters and the
        optimizer's state (see :mod:`mixprec._src.scaling.closure`, which also states the memory
        cost).

        Raises:
            ScalerStateError: no ``scale()`` yet, or stepped twice.
            MissingGradError: none of the optimizer's parameters has a grad (names them).

        Host sync: one per call for non-fused optimizers (to decide whether to call
        ``optimizer.step``); none for fused ones, except on their first step; with a closure,
        one per closure evaluation.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        call = split_closure(args, kwargs)
        if call is not None:
            return step_with_closure(self, optimizer, call)
        self._require_state("step")
        record = self._phases.check_can_step(optimizer)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._step_fused(optimizer, record, args, kwargs)
        if record.stage is OptState.READY:
            self._unscale_for_step(optimizer, record)
        found_inf = self._sum_found_inf(record, optimizer)
        self._note_step(optimizer, found_inf)
        record.skipped = bool(found_inf.item() != 0)
        record.stage = OptState.STEPPED  # before the call: if it raises, a retry is refused
        return None if record.skipped else optimizer.step(*args, **kwargs)

    def _sum_found_inf(self, record: OptimizerRecord, optimizer: _Optimizer) -> torch.Tensor:
        found = list(record.found_inf_per_device.values())
        if not found:
            raise MissingGradError(
                diagnostics.no_inf_checks_message("for this optimizer", record.missing)
            )
        return _sum_on(found, self._require_state("step").scale.device)

    def _step_fused(
        self,
        optimizer: _Optimizer,
        record: OptimizerRecord,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        if takes_grad_scaler(optimizer):
            return self._step_legacy_fused(optimizer, record, args, kwargs)
        if record.stage is OptState.READY and self._mirror.scale_may_be_below_one:
            self._unscale_for_step(optimizer, record)  # the kernel's division could overflow
        scale_device = self._require_state("step").scale.device
        if record.stage is OptState.READY:
            plan, group, agree = self._dist.prepare(plan_grads(optimizer))
            check_finite_(plan, record.found_inf_per_device)
            record.mark_checked(optimizer, plan.missing)
            if agree:
                self._dist.agree_(record.found_inf_per_device, group, scale_device)
        found_inf = self._sum_found_inf(record, optimizer)
        scale = self._require_state("step").scale
        if record.stage is OptState.UNSCALED:
            grad_scale = getattr(optimizer, "grad_scale", None)
        else:
            grad_scale = scale * getattr(optimizer, "grad_scale", 1)
        record.stage = OptState.STEPPED
        self._note_step(optimizer, found_inf)
        if has_uninitialised_state(optimizer):
            record.skipped = bool(found_inf.item() != 0)
            if record.skipped:
                return None
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]

    def _step_legacy_fused(
        self,
        optimizer: _Optimizer,
        record: OptimizerRecord,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        warnings.warn(
            "GradScaler is going to stop passing itself as a keyword argument to the passed "
            "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
            "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
            FutureWarning,
            stacklevel=3,
        )
        kwargs = {**kwargs, "grad_scaler": self}
        result = optimizer.step(*args, **kwargs)
        record.stage = OptState.STEPPED
        if record.found_inf_per_device:
            self._note_step(optimizer, self._sum_found_inf(record, optimizer))
        return result

    def _note_step(self, optimizer: _Optimizer, found_inf: torch.Tensor) -> None:
        self._phases.get(optimizer).optimizer = weakref.ref(optimizer)
        self._step_skips[id(optimizer)] = found_inf  # non-zero: skipped (compared when read)

    # ------------------------------------------------------------------ update

    def update(self, new_scale: float | torch.Tensor | _Optimizer | None = None) -> None:
        """End the iteration: back off after an overflow, grow after enough clean iterations.

        ``new_scale`` may be a float/int or a 1-element tensor to set the scale directly (the
        growth counter is kept), or, as some pages on ``GradScaler.update`` write it, the
        optimizer that stepped this iteration: ``update(optimizer)`` is ``update()`` after
        checking that this optimizer was unscaled or stepped since the last update.

        Raises:
            MissingGradError: nothing was unscaled or stepped since the last update.
            ScalerStateError: no ``scale()`` yet.
            ConfigError: ``new_scale`` is not finite and > 0, or a bad tensor.

        Host sync: none (one when ``max_consecutive_skips`` is set and the iteration's outcome
        is not already known on the host, i.e. fused optimizers off the CPU).
        """
        if not self._enabled:
            return
        if isinstance(new_scale, _Optimizer) or hasattr(new_scale, "param_groups"):
            self._check_update_optimizer(new_scale)
            new_scale = None
        state = self._require_state("update")
        if new_scale is not None:  # a bad value raises before the iteration ends (as torch)
            validated_new_scale(new_scale, state.scale.device, self._config)
        try:
            if new_scale is not None:
                self._set_scale(state, new_scale)
            else:
                self._apply_rule(state)
        finally:
            self._end_iteration()

    def _check_update_optimizer(self, optimizer: Any) -> None:
        record = self._phases.peek(optimizer)
        if record is None or record.stage is OptState.READY:
            raise ScalerStateError(
                "update(optimizer) was given an optimizer that was neither unscaled nor stepped "
                "since the last update(). Call scaler.step(optimizer) (or "
                "scaler.unscale_(optimizer)) first, or call scaler.update() with no argument."
            )

    def _advance_state(
        self, state: ScaleState, total: torch.Tensor, overflow: bool | None
    ) -> torch.Tensor:
        """Apply the rule to ``state`` and the host mirror; return the scale used this iteration.

        On the CPU (outside torch.compile) the host is the device: the rule runs on Python
        numbers and the results are written into the tensors. Elsewhere it runs on the device.
        """
        before = self._mirror.exact
        if state.scale.is_cpu and before is not None and not torch.compiler.is_compiling():
            if overflow is None:
                overflow = bool(total.item() != 0)
            used = state.scale.clone() if self._history.capacity else state.scale
            after = before.advance(overflow, self._config)
            write_host_update_(state, before, after)
            self._mirror.set_exact(after)
            if after.scale != before.scale:
                self._inv_scale = None
            return used
        # The floor clamp is needed only when one backoff could take the scale near it.
        near_floor = self._mirror.lower_bound * self._config.backoff_factor < 4 * self._config.floor
        used = update_scale_(state, total, self._config, clamp=near_floor)
        self._mirror.advance(state, overflow, self._config, total)
        self._inv_scale = None
        return used

    def _set_scale(self, state: ScaleState, new_scale: float | torch.Tensor) -> None:
        value = validated_new_scale(new_scale, state.scale.device, self._config)
        self._inv_scale = None
        if isinstance(value, torch.Tensor):
            state.scale.copy_(value)
            self._mirror.set_scale(None if value.device.type != "cpu" else value.item())
        else:
            state.scale.fill_(value)
            self._mirror.set_scale(to_f32(value))

    def _apply_rule(self, state: ScaleState) -> None:
        records = self._phases.records()
        found = [f for r in records for f in r.found_inf_per_device.values()]
        if not records:
            raise MissingGradError(
                "No inf checks were recorded prior to update(): no optimizer was unscaled or "
                "stepped since the last update(). Call scaler.step(optimizer) before "
                "scaler.update(), and update() once per iteration."
            )
        if not found:
            missing = [ref for r in records for ref in r.missing]
            raise MissingGradError(diagnostics.no_inf_checks_message("prior to update", missing))
        total = _sum_on(found, state.scale.device)
        skipped = [r.skipped for r in records]
        overflow = None if None in skipped else any(skipped)
        used_scale = self._advance_state(state, total, overflow)
        iteration = self._next_iteration(state)  # compile-safe, see ScalerCore._next_iteration
        self._last_iteration_skip = total  # non-zero: skipped (compared when read)
        if self._hooks or self._history.capacity:
            event = UpdateEvent(iteration, state.scale, total, total != 0)
            self._history.record(iteration, used_scale, event.skipped)
            for hook in list(self._hooks.values()):
                hook(self, event)
        self._watch(state, records)
