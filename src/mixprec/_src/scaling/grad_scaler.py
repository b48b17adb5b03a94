"""GradScaler, composed of the parts it owns (``docs/internals.md`` draws them); closures and
``JoinableScaler`` use only the private methods at the end of the class."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from mixprec._src import optim, torch_compat
from mixprec._src.dist.agree import validate_group
from mixprec._src.dist.state import DistState
from mixprec._src.kernels import clip
from mixprec._src.kernels.plan import GradPlan, plan_grads
from mixprec._src.kernels.unscale import check_finite_, unscale_grads_
from mixprec._src.scaling import telemetry
from mixprec._src.scaling.checkpoint import export_state, parse_state_dict
from mixprec._src.scaling.closure import step_with_closure
from mixprec._src.scaling.config import (
    SIGNATURE,
    ScalerConfig,
    Settings,
    settings_from,
    validated_new_scale,
)
from mixprec._src.scaling.nested import scale_nested
from mixprec._src.scaling.phases import OptimizerRecord, OptState, PhaseTable, low_precision_message
from mixprec._src.scaling.rule import Values
from mixprec._src.scaling.state import ScaleState
from mixprec.errors import LowPrecisionGradError, MixprecWarning

_Optimizer = torch.optim.Optimizer


class GradScaler:
    """Dynamic loss scaling, a drop-in for ``torch.amp.GradScaler`` on every device.

    Both call forms work: torch 2's ``GradScaler("cuda", init_scale, growth_factor,
    backoff_factor, growth_interval, enabled)`` and torch.cuda.amp 1.5's (without ``device``).
    The scale lives on the device of the first tensor passed to :meth:`scale`, whatever ``device``
    says. With default settings the scale trajectory, the skipped steps and the parameters are
    bit-identical to torch's.

    Args:
        device: accepted for compatibility; where the scale lives is decided by the outputs.
        init_scale: first scale, a normal float32 (rounded to float32 as torch rounds it).
        growth_factor: multiplier after ``growth_interval`` clean iterations, > 1.
        backoff_factor: multiplier after an overflowing iteration, in (0, 1).
        growth_interval: clean iterations before a growth, an int >= 1.
        enabled: ``False`` makes every method a pass-through (``step`` just steps).
        min_scale: keyword-only lower bound (default: the smallest normal float32, never 0).
        max_scale: keyword-only upper bound (default: none; growth never reaches inf).
        hysteresis: keyword-only; back off only on the N-th consecutive overflowing iteration.
        max_consecutive_skips: keyword-only; raise
            :class:`~mixprec.errors.ScaleCollapseError` on the N-th consecutive skipped iteration.
        history: keyword-only; iterations of scale history kept (at most 1,000,000).
        process_group: keyword-only group the grads are sharded over (FSDP1, ZeRO, tensor
            parallel): its ranks agree on every skip and the clip norm (``docs/distributed.md``).

    See ``docs/grad-scaler.md`` for the iteration and ``docs/api.md`` for every method.
    """

    __signature__ = SIGNATURE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings, group = settings_from(args, kwargs)
        self._settings: Settings = settings
        self._telemetry = telemetry.Telemetry(settings.history)
        self._state = ScaleState(Values(settings.config.init_scale), self._recorder())
        self._phases = PhaseTable()
        self._dist = DistState(validate_group(group))

    # ------------------------------------------------------------------ the iteration

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or a nested list/tuple/dict/iterable of tensors, by the scale,
        created on the device of the first tensor met (other devices get a copy). Containers keep
        their type where they can be rebuilt. As in torch, a 0-d fp16 loss becomes fp32.

        Raises:
            ConfigError: a leaf is not a tensor, a container cannot be rebuilt (named), or the
                first tensor is on the meta device.

        Host sync: none.
        """
        if not self._settings.enabled:
            return outputs
        scaled = scale_nested(outputs, self._state.scale_on)
        self._phases.note_scaled(scaled)
        return scaled

    def unscale_(self, optimizer: _Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and check them for inf/NaN,
        at most once per optimizer per iteration (``step`` does it otherwise). Overflow created by
        the division itself (a scale below 1) is detected too, which torch misses.

        Raises:
            ScalerStateError: no ``scale()`` yet, or already unscaled/stepped this iteration.
            LowPrecisionGradError: some gradients are fp16 (names them; nothing is changed).

        Host sync: none.
        """
        if not self._settings.enabled:
            return
        self._phases.require_scale(self._state.scale is not None, "unscale_")
        self._pass(optimizer, self._phases.begin_unscale(optimizer), unscale=True)

    def step(self, optimizer: _Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` already did) and step, unless a grad is inf/NaN.

        Returns ``optimizer.step(*args, **kwargs)``'s value, or ``None`` when skipped (nothing
        changed). ``fused=True`` optimizers get ``grad_scale``/``found_inf`` and skip inside their
        kernel, as with torch; a closure's every evaluation is unscaled and checked
        (``docs/closures.md``).

        Raises:
            ScalerStateError: no ``scale()`` yet, or stepped twice.
            MissingGradError: none of the optimizer's parameters has a grad (names them).

        Host sync: one for non-fused optimizers (whether to call ``optimizer.step``); none for
        fused ones after their first step; with a closure, one per closure evaluation.
        """
        if not self._settings.enabled:
            return optimizer.step(*args, **kwargs)
        call = optim.split_closure(args, kwargs) if args or kwargs else None
        scaled = call is not None or self._state.scale is not None  # (a closure may scale first)
        record = self._phases.begin_step(optimizer, scaled)
        if call is not None:
            return step_with_closure(self, self._phases, optimizer, record, call)
        if not torch_compat.steps_with_amp_scaling(optimizer):
            return self._step_plain(optimizer, record, args, kwargs)
        if not optim.takes_grad_scaler(optimizer):
            first = optim.needs_first_step_read(optimizer)  # (its state is created by this step)
            return self._step_fused(optimizer, record, first, args, kwargs)
        result = optim.legacy_step(optimizer, self, args, kwargs)
        self._phases.mark_stepped(record, optimizer, None)
        if record.found_inf_per_device:  # the optimizer called _check_inf_per_device
            found_inf = self._phases.found_inf(record, optimizer, self._state.device)
            self._telemetry.note_step(optimizer, found_inf)
        return result

    def update(self, new_scale: float | torch.Tensor | _Optimizer | None = None) -> None:
        """End the iteration: back off after an overflow, grow after enough clean iterations.

        ``new_scale`` may be a number or a 1-element tensor that sets the scale (rounded to
        float32; the growth tracker is kept), or, as some pages on ``GradScaler.update`` write it,
        the optimizer that stepped: ``update(optimizer)`` checks it was unscaled or stepped.

        Raises:
            MissingGradError: nothing was unscaled or stepped since the last update.
            ScalerStateError: no ``scale()`` yet.
            ConfigError: ``new_scale`` is not finite and within the bounds, or a bad tensor.

        Host sync: none; one with ``max_consecutive_skips`` when the outcome is not known on the
        host (fused optimizers off the CPU), and for ``new_scale`` there (or a tensor one).
        """
        if not self._settings.enabled:
            return
        if new_scale is not None and hasattr(new_scale, "param_groups"):
            self._phases.require_touched(new_scale)
            new_scale = None
        self._phases.require_scale(self._state.scale is not None, "update")
        config = self._settings.config
        if new_scale is not None:  # a bad value raises before the iteration ends (as torch)
            value = validated_new_scale(new_scale, self._state.device, config)
        try:
            if new_scale is not None:
                self._state.load(self._state.values()._replace(scale=value))
                return
            total, overflow = self._phases.outcome(self._state.device)
            iteration, values = self._state.advance(total, overflow, config)
            limit = config.max_consecutive_skips
            if values is None and limit is not None:
                values = self._state.values()  # the limit must be checked now: read the device
            scale, stepped = self._state.scale, self._phases.stepped
            self._telemetry.after_update(self, iteration, scale, total, values, limit, stepped)
        finally:
            self._end_iteration()

    def reset_iteration(self) -> None:
        """Abandon the current iteration after an exception: every optimizer is READY again.

        The scale, tracker and counters stay as they were and the gradients are not touched (zero
        them before the next backward). A no-op between iterations and when disabled.

        Host sync: none.
        """
        self._end_iteration()

    def _recorder(self) -> Callable[[int, float, bool], None] | None:
        return self._telemetry.history.record if self._telemetry.history.capacity else None

    def _end_iteration(self) -> None:
        self._dist.end_iteration()
        self._phases.end_iteration()

    def _pass(self, optimizer: _Optimizer, record: OptimizerRecord, unscale: bool) -> GradPlan:
        """The one pass over the grads: unscale them in place by ``1/scale`` (a deferred clip's
        ``coefficient/scale``), refusing fp16 grads first (LowPrecisionGradError), or check them."""
        plan, group, agree = self._dist.prepare(plan_grads(optimizer))
        flags, deferred = record.found_inf_per_device, record.deferred
        if unscale and deferred is None and plan.low_precision:
            raise LowPrecisionGradError(low_precision_message(plan.low_precision))
        if not unscale:
            check_finite_(plan, flags)
        elif deferred is None:
            inv, below_one = self._state.inv_scale(), self._state.may_be_below_one
            unscale_grads_(plan, inv, flags, check_output=below_one)
        else:  # the flags were set when the norm was measured (and agreed on by its all-reduce)
            factor = deferred * self._state.inv_scale().to(deferred.device)
            unscale_grads_(plan, factor, flags, check_output=False)
        if agree and deferred is None:  # one all-reduce per optimizer per iteration
            self._dist.agree_(flags, group, self._state.device)
        self._phases.mark_pass(record, optimizer, plan.missing, unscale)
        return plan

    def _checked(self, optimizer: _Optimizer, record: OptimizerRecord, unscale: bool) -> Any:
        """The step's pass unless done (a deferred clip when unscaling) and the combined overflow
        flag (MissingGradError when nothing was checked)."""
        if record.stage is OptState.READY or (unscale and record.deferred is not None):
            self._pass(optimizer, record, unscale)
            self._phases.reopen_if_unchecked(record)  # a retry after backward() unscales
        return self._phases.found_inf(record, optimizer, self._state.device)

    def _step_plain(
        self, optimizer: _Optimizer, record: OptimizerRecord, args: tuple, kwargs: dict
    ) -> Any:
        """Unscale if needed, read the flag (one host sync) and step unless it overflowed."""
        found_inf = self._checked(optimizer, record, unscale=True)
        skipped = bool(found_inf.item() != 0)
        self._phases.mark_stepped(record, optimizer, skipped)  # before: a retry is refused
        self._telemetry.note_step(optimizer, found_inf)
        return None if skipped else optimizer.step(*args, **kwargs)

    def _step_fused(
        self, optimizer: _Optimizer, record: OptimizerRecord, first: bool, args: tuple, kwargs: dict
    ) -> Any:
        """Hand ``grad_scale``/``found_inf`` to an optimizer that skips inside its kernel; on a
        ``first`` step, which creates its state, read the flag instead (one host sync)."""
        # Below a scale of 1 the kernel's division could overflow: unscale here instead.
        unscale = record.stage is OptState.READY and self._state.may_be_below_one
        grad_scale = user = getattr(optimizer, "grad_scale", None)
        if not unscale and (record.stage is OptState.READY or record.deferred is not None):
            grad_scale = self._state.scale  # (else unscaled, and clipped: divide no more)
            assert grad_scale is not None
            if record.deferred is not None:  # grads / (scale / c) = unscaled grads * c
                grad_scale = grad_scale / record.deferred.to(grad_scale.device, torch.float32)
            grad_scale = grad_scale if user is None else grad_scale * user
        found_inf = self._checked(optimizer, record, unscale)
        skipped = bool(found_inf.item() != 0) if first else None
        self._phases.mark_stepped(record, optimizer, skipped)
        self._telemetry.note_step(optimizer, found_inf)
        return None if skipped else optim.fused_step(optimizer, grad_scale, found_inf, args, kwargs)

    def clip_grad_norm_(
        self,
        optimizer: _Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *,
        parameters: Iterable[torch.Tensor] | None = None,
        in_step: bool = False,
    ) -> torch.Tensor:
        """``unscale_(optimizer)`` then ``torch.nn.utils.clip_grad_norm_``, in two passes, counted
        as this iteration's ``unscale_``; returns the unscaled norm before clipping (0-d, on the
        grads' device). ``parameters`` sets torch's summation order; ``in_step=True`` clips
        inside the next ``step`` (a fused optimizer's ``grad_scale``) and leaves ``.grad``
        scaled until then. Results and summation order: ``docs/clipping.md``.

        Raises:
            ScalerStateError: no ``scale()`` yet, or already unscaled, clipped or stepped.
            LowPrecisionGradError: some gradients are fp16 (names them; nothing is changed).
            ConfigError: a bad ``max_norm``/``norm_type``/``parameters``, or sparse gradients.
            NonFiniteNormError: ``error_if_nonfinite=True`` and the norm is inf/NaN.

        Host sync: none; one with ``error_if_nonfinite=True``.
        """
        if not self._settings.enabled:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        norm_type = clip.validate_norm_type(norm_type)
        limit = clip.validated_limit(max_norm, "max_norm")
        self._phases.require_scale(self._state.scale is not None, "clip_grad_norm_")
        record = self._phases.begin_unscale(optimizer, "clip_grad_norm_")
        plan, flags, sharded = self._dist.prepare_clip(plan_grads(optimizer))
        if plan.low_precision:
            raise LowPrecisionGradError(low_precision_message(plan.low_precision))
        clip.validate_plan(plan, "clip_grad_norm_")
        order = None
        if parameters is not None:  # the norm summed in the order torch's clip would sum it
            listed = clip.grouped_like(parameters, plan_grads(optimizer).all_grads())
            order = self._dist.prepare_clip(GradPlan(dense=listed))[0].dense
        reduce = None  # sharded grads: the global norm, one all-reduce (mixprec._src.dist)
        if sharded is not None:
            reduce = functools.partial(self._dist.reduce_norm_, norm_type=norm_type, group=sharded)
        inv, found = self._state.inv_scale(), record.found_inf_per_device
        total, coefficient = clip.clip_grad_norm_(
            plan, inv, found, limit, norm_type, check_output=self._state.may_be_below_one,
            error_if_nonfinite=error_if_nonfinite, reduce_norm=reduce, norm_groups=order,
            defer=in_step,
        )  # fmt: skip
        if flags is not None and sharded is None:  # replicated grads under Join: flags only
            self._dist.agree_(found, flags, inv.device)
        deferred = coefficient if in_step else None
        self._phases.mark_pass(record, optimizer, plan.missing, True, deferred)
        return total

    def clip_grad_value_(self, optimizer: _Optimizer, clip_value: float) -> None:
        """Unscale the optimizer's gradients and clamp them to ``[-clip_value, clip_value]``.

        Does what ``unscale_`` then ``torch.nn.utils.clip_grad_value_`` do (bit-identical) and
        counts as this iteration's ``unscale_``; overflow is detected before the clamp.

        Raises:
            ScalerStateError, LowPrecisionGradError: as :meth:`clip_grad_norm_`.
            ConfigError: a bad ``clip_value``, or sparse gradients.

        Host sync: none.
        """
        if not self._settings.enabled:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_value_(params, clip_value)
            return
        limit = clip.validated_limit(clip_value, "clip_value")
        self._phases.require_scale(self._state.scale is not None, "clip_grad_value_")
        record = self._phases.begin_unscale(optimizer, "clip_grad_value_")
        clip.validate_plan(plan_grads(optimizer), "clip_grad_value_")  # before anything changes
        clip.clamp_(self._pass(optimizer, record, unscale=True), limit)  # (flags before the clamp)

    def last_step_skipped(self, optimizer: _Optimizer | None = None) -> bool:
        """Whether the last ``step`` of ``optimizer`` was skipped (any optimizer of the current
        or, after ``update()``, the last iteration when ``optimizer`` is None); right for fused
        optimizers too. Use it to advance LR schedulers and EMAs on real updates only.

        Raises:
            ScalerStateError: that optimizer (or any) has not been stepped yet.

        Host sync: one (use :meth:`last_step_skipped_async` to avoid it).
        """
        return bool(self.last_step_skipped_async(optimizer).item())

    def last_step_skipped_async(self, optimizer: _Optimizer | None = None) -> torch.Tensor:
        """:meth:`last_step_skipped` as a 0-d bool tensor on the scale's device. Host sync: none."""
        if not self._settings.enabled:
            return torch.zeros((), dtype=torch.bool)
        flag = self._telemetry.skip_flag(optimizer, self._phases.stepped())
        return self._phases.require_step_seen(flag, optimizer)

    def stats(self) -> telemetry.ScalerStats:
        """Counters since creation (or since the loaded state dict) and the current scale; emits
        the collapse warnings ``update()`` could not (fused optimizers off the CPU).

        Host sync: one, when the scale lives on an accelerator and updates ran there unread.
        """
        unseen = self._state.read_pending
        return self._telemetry.stats(self._state.values(), unseen, self._settings.enabled)

    def history(self) -> list[telemetry.HistoryEntry]:
        """The last ``history`` iterations (constructor argument), oldest first. Host sync: one."""
        self._state.values()  # (on the device path the history is completed when read)
        return self._telemetry.history.entries()

    def register_update_hook(
        self, hook: Callable[[GradScaler, telemetry.UpdateEvent], None]
    ) -> RemovableHandle:
        """Call ``hook(scaler, event)`` after every rule update (not after ``update(new_scale)``);
        the event holds device tensors. Returns a handle whose ``remove()`` unregisters it.

        Host sync: none (unless the hook reads the tensors).
        """
        return self._telemetry.register(hook)

    def diagnose(self, optimizer: _Optimizer | None = None) -> telemetry.Diagnosis:
        """Parameters of ``optimizer`` (default: those stepped or unscaled this iteration) whose
        grads are inf/NaN or missing, by name when the optimizer knows names. Host sync: one."""
        return telemetry.diagnose_optimizers([optimizer] if optimizer else self._phases.stepped())

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Host sync: one, when the
        scale lives on an accelerator and updates ran there unread."""
        return self._state.values().scale if self._settings.enabled else 1.0

    def get_growth_factor(self) -> float:
        """The growth factor. Host sync: none."""
        return self._settings.config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1; else ConfigError). Host sync: as :meth:`get_scale`."""
        self._reconfigure(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor. Host sync: none."""
        return self._settings.config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1); else ConfigError). Host sync: as :meth:`get_scale`."""
        self._reconfigure(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval. Host sync: none."""
        return self._settings.config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an int >= 1; else ConfigError). Clean iterations counted past
        it are capped at one short of it, so the scale grows at the next clean one (torch's kernel
        compares with ``==`` and would not grow for 2**31 iterations). Host sync: as
        :meth:`get_scale`."""
        self._reconfigure(growth_interval=new_interval)
        values, cap = self._state.values(), new_interval - 1
        self._state.load(values._replace(growth_tracker=min(values.growth_tracker, cap)))

    def _reconfigure(self, **changes: Any) -> None:
        settings = self._settings.with_config(**changes)  # (validated before anything changes)
        self._state.values()  # updates that ran unread are replayed with the old settings
        self._settings = settings

    def is_enabled(self) -> bool:
        """Whether this scaler scales. Host sync: none."""
        return self._settings.enabled

    @property
    def config(self) -> ScalerConfig:
        """The current settings (frozen; change them through the setters). Host sync: none."""
        return self._settings.config

    @property
    def process_group(self) -> Any:
        """The group the grads are sharded over, whose ranks agree on every skip (None: only
        DTensor grads agree; DDP needs none). Not saved in state dicts or pickles. The setter
        raises ConfigError for anything but None or a ``ProcessGroup``. Host sync: none."""
        return self._dist.group

    @process_group.setter
    def process_group(self, group: Any) -> None:
        self._dist.group = validate_group(group)

    def state_dict(self) -> dict[str, Any]:
        """torch's five keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) plus mixprec's own, which torch ignores when
        loading; ``{}`` when disabled. Host sync: as :meth:`get_scale`."""
        if not self._settings.enabled:
            return {}
        return export_state(self._settings.config, self._state.values())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or from ``torch.amp.GradScaler``.

        Everything is validated before anything changes; it works before the first ``scale()``
        and is a no-op when disabled. A scale outside this scaler's bounds is loaded as the
        nearest bound, with a :class:`~mixprec.errors.MixprecWarning` saying so.

        Raises:
            ConfigError: empty dict, missing keys, or values of the wrong type or range.
            ScalerStateError: called mid-iteration (after ``scale()``, ``unscale_`` or ``step``):
                call ``update()`` or :meth:`reset_iteration` first.

        Host sync: none.
        """
        if not self._settings.enabled:
            return
        config, values, note = parse_state_dict(state_dict, self._settings.config)
        self._phases.require_between_iterations("load_state_dict")
        if note is not None:
            warnings.warn(note, MixprecWarning, stacklevel=2)
        self._settings = Settings(config, True, self._settings.history, self._settings.device)
        self._state.load(values)
        self._end_iteration()

    def __getstate__(self) -> dict[str, Any]:
        if self._settings.enabled:
            self._phases.require_between_iterations("pickle")
        values = self._state.values()  # (the telemetry pickles without hooks and skip flags)
        return {"settings": self._settings, "values": values, "telemetry": self._telemetry}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._settings = state["settings"]
        self._telemetry = state["telemetry"]
        self._state = ScaleState(state["values"], self._recorder())
        self._phases = PhaseTable()
        self._dist = DistState()  # process groups do not pickle; set it again

    # ------------------------------------------------------------------ torch's private API

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        self._state.materialize(torch.device(dev))  # (accelerate calls it)

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._state.scale

    def _get_growth_tracker(self) -> int:
        return self._state.values().growth_tracker if self._settings.enabled else 0

    _scale = property(_get_scale_async)
    _growth_tracker = property(lambda self: self._state.growth_tracker())

    def _check_inf_per_device(self, optimizer: _Optimizer) -> dict[torch.device, torch.Tensor]:
        """Check the grads without unscaling them (torch's legacy fused contract)."""
        self._phases.require_scale(self._state.scale is not None, "_check_inf_per_device")
        record = self._phases.get(optimizer)
        self._pass(optimizer, record, unscale=False)
        return record.found_inf_per_device

    def _found_inf_per_device(self, optimizer: _Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._phases.get(optimizer).found_inf_per_device

    # ------------------------------------------------------------------ closures (Stepper), Join

    def _evaluated(self, optimizer: _Optimizer, record: OptimizerRecord) -> bool:
        """A closure evaluation's grads unscaled (unless done) and checked: overflowed?"""
        return bool(self._checked(optimizer, record, unscale=True).item() != 0)

    def _flag(self, optimizer: _Optimizer, record: OptimizerRecord) -> torch.Tensor:
        return self._phases.found_inf(record, optimizer, self._state.device)

    def _unscaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss / self._state.scale_on(loss.device)

    def _stepped(self, optimizer: _Optimizer, record: OptimizerRecord, skipped: bool) -> None:
        self._telemetry.note_step(optimizer, self._flag(optimizer, record))
        self._phases.mark_stepped(record, optimizer, skipped)

    def _join(self, joinable: Any, group: Any) -> None:
        self._dist.join(joinable, group)

    def _shadow_iteration(self, group: Any, device: torch.device) -> None:
        """A joined rank's stand-in: the last iteration's all-reduces with 0, then update()."""
        device = self._state.materialize(device).scale.device
        self._phases.shadow(self._dist.shadow_flags(group, device))
        self.update()
