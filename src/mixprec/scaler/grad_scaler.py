"""GradScaler: a thin shell that sequences the iteration and delegates the arithmetic.

The pure parts live beside it: the settings (``config``), the update rule (``rule``), the phases of
each optimizer (``phases``), the host's view of the scale (``telemetry``), state-dict validation
(``state``), the messages (``diagnostics``) and the passes over gradients (``kernels``).
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from mixprec.errors import (
    ConfigError,
    LowPrecisionGradError,
    MissingGradError,
    ScaleCollapseError,
    ScaleCollapseWarning,
    ScalerStateError,
)
from mixprec.kernels.plan import GradPlan, plan_grads
from mixprec.kernels.unscale import check_finite_, unscale_grads_
from mixprec.scaler import diagnostics
from mixprec.scaler.args import SIGNATURE, bind_constructor_args, parse_device
from mixprec.scaler.checks import has_uninitialised_state, validated_new_scale
from mixprec.scaler.config import ScalerConfig
from mixprec.scaler.phases import OptimizerRecord, OptState, PhaseTable
from mixprec.scaler.rule import ScaleState, to_f32, update_scale_
from mixprec.scaler.state import LoadedState, export_state, parse_state_dict
from mixprec.scaler.telemetry import (
    History,
    HistoryEntry,
    HostMirror,
    ScalerStats,
    UpdateEvent,
    read_stats,
)

__all__ = ["GradScaler"]

#: Consecutive skipped iterations after which a warning is emitted (once).
_SKIP_WARNING = 50


def _warn(message: str) -> None:
    warnings.warn(message, ScaleCollapseWarning, stacklevel=4)


_Optimizer = torch.optim.Optimizer


class GradScaler:
    """Dynamic loss scaling, a drop-in for ``torch.amp.GradScaler`` on every device.

    Both call forms work: torch 2's ``GradScaler("cuda", init_scale, growth_factor,
    backoff_factor, growth_interval, enabled)`` and the seed's (torch.cuda.amp's)
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
        max_consecutive_skips: keyword-only; raise :class:`~mixprec.ScaleCollapseError` on the
            N-th consecutive skipped iteration.

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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = bind_constructor_args(args, kwargs)
        enabled = bound.pop("enabled")
        if not isinstance(enabled, bool):
            raise ConfigError(f"enabled must be a bool, got {enabled!r}.")
        device = parse_device(bound.pop("device"))
        history = bound.pop("history")
        if isinstance(history, bool) or not isinstance(history, int) or history < 0:
            raise ConfigError(f"history must be an int >= 0 (entries kept), got {history!r}.")
        self._config = ScalerConfig(**bound)
        self._enabled = enabled
        self._device = device.type if device is not None else None
        self._state: ScaleState | None = None
        self._pending = LoadedState(self._config, self._config.init_scale, 0, 0, [0, 0, 0, 0])
        self._phases = PhaseTable()
        self._mirror = HostMirror(self._config.init_scale, 0, 0)
        self._per_device_cache: dict[torch.device, torch.Tensor] = {}
        self._inv_scale: torch.Tensor | None = None
        self._history = History(history)
        self._hooks: dict[int, Callable[[GradScaler, UpdateEvent], None]] = {}
        self._iteration = 0
        self._step_skips: dict[int, torch.Tensor] = {}
        self._last_iteration_skip: torch.Tensor | None = None
        self._warned: set[str] = set()

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

    def _lazy_init(self, device: torch.device) -> ScaleState:
        if self._state is None:
            pending = self._pending
            self._state = ScaleState.create(
                pending.scale,
                pending.growth_tracker,
                pending.overflow_streak,
                device,
                pending.counters,
            )
            self._device = device.type
        return self._state

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        """Create the scale tensors on ``dev`` now (torch's private hook, used by accelerate).

        Host sync: none.
        """
        self._lazy_init(torch.device(dev))

    def _require_state(self, method: str) -> ScaleState:
        if self._state is None:
            raise ScalerStateError(diagnostics.no_scale_message(method))
        return self._state

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
        plan = plan_grads(optimizer)
        if plan.low_precision:
            raise LowPrecisionGradError(diagnostics.low_precision_message(plan.low_precision))
        unscale_grads_(
            plan,
            self._get_inv_scale(),
            record.found_inf_per_device,
            check_output=self._mirror.scale_may_be_below_one,
        )
        record.stage = OptState.UNSCALED
        record.missing = plan.missing
        record.optimizer = weakref.ref(optimizer)
        return plan

    def _get_inv_scale(self) -> torch.Tensor:
        if self._inv_scale is None:
            scale = self._require_state("unscale_").scale
            if scale.device.type == "mps":  # no float64 on MPS
                self._inv_scale = scale.reciprocal()
            else:
                self._inv_scale = scale.double().reciprocal().float()
        return self._inv_scale

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

        Raises:
            ScalerStateError: no ``scale()`` yet, stepped twice, or a closure was passed.
            MissingGradError: none of the optimizer's parameters has a grad (names them).

        Host sync: one per call for non-fused optimizers (to decide whether to call
        ``optimizer.step``); none for fused ones, except on their first step.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or (args and callable(args[0])):
            raise ScalerStateError(
                "Closure use is not supported by GradScaler.step yet: the closure would "
                "recompute scaled gradients that are never unscaled. Compute the loss and "
                "backward() before step(), or use enabled=False for closure-based optimizers."
            )
        self._require_state("step")
        record = self._phases.check_can_step(optimizer)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._step_fused(optimizer, record, args, kwargs)
        if record.stage is OptState.READY:
            self._unscale_into(optimizer, record)
        found_inf = self._sum_found_inf(record, optimizer)
        self._note_step(optimizer, found_inf)
        record.skipped = bool(found_inf.item() != 0)
        result = None if record.skipped else optimizer.step(*args, **kwargs)
        record.stage = OptState.STEPPED
        return result

    def _sum_found_inf(self, record: OptimizerRecord, optimizer: _Optimizer) -> torch.Tensor:
        found = list(record.found_inf_per_device.values())
        if not found:
            raise MissingGradError(
                diagnostics.no_inf_checks_message("for this optimizer", record.missing)
            )
        device = self._require_state("step").scale.device
        total = found[0].to(device, non_blocking=True)
        for other in found[1:]:
            total = total + other.to(device, non_blocking=True)
        return total

    def _step_fused(
        self,
        optimizer: _Optimizer,
        record: OptimizerRecord,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            return self._step_legacy_fused(optimizer, record, args, kwargs)
        if record.stage is OptState.READY and self._mirror.scale_may_be_below_one:
            self._unscale_into(optimizer, record)  # the kernel's own division could overflow
        if record.stage is OptState.READY:
            record.optimizer = weakref.ref(optimizer)
            plan = plan_grads(optimizer)
            check_finite_(plan, record.found_inf_per_device)
            record.missing = plan.missing
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
        self._step_skips[id(optimizer)] = found_inf != 0

    # ------------------------------------------------------------------ update

    def update(self, new_scale: float | torch.Tensor | _Optimizer | None = None) -> None:
        """End the iteration: back off after an overflow, grow after enough clean iterations.

        ``new_scale`` may be a float/int or a 1-element tensor to set the scale directly (the
        growth counter is kept), or, as the second seed documents, the optimizer that stepped
        this iteration: ``update(optimizer)`` is ``update()`` after checking that this
        optimizer was unscaled or stepped since the last update.

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

    def _set_scale(self, state: ScaleState, new_scale: float | torch.Tensor) -> None:
        value = validated_new_scale(new_scale, state.scale.device, self._config)
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
        total = found[0].to(state.scale.device, non_blocking=True)
        for other in found[1:]:
            total = total + other.to(state.scale.device, non_blocking=True)
        used_scale = update_scale_(state, total, self._config)
        skipped = [r.skipped for r in records]
        overflow = None if None in skipped else any(skipped)
        self._mirror.advance(state, overflow, self._config)
        self._iteration += 1
        event = UpdateEvent(self._iteration, state.scale, total, total != 0)
        self._last_iteration_skip = event.skipped
        self._history.record(self._iteration, used_scale, event.skipped)
        for hook in list(self._hooks.values()):
            hook(self, event)
        self._watch(state, records)

    def _watch(self, state: ScaleState, records: list[OptimizerRecord]) -> None:
        """Warn once when the scale drops below 1 or 50 iterations in a row were skipped;
        raise on ``max_consecutive_skips``. Uses the host mirror, so it syncs only when the
        mirror is unknown and ``max_consecutive_skips`` is set."""
        limit = self._config.max_consecutive_skips
        exact = self._mirror.exact
        if exact is None and limit is not None:
            exact = self._mirror.resync(state)
        if exact is None:
            return
        streak = exact.overflow_streak
        if limit is not None and streak >= limit:
            raise ScaleCollapseError(
                self._collapse_text(
                    f"{streak} consecutive iterations overflowed", exact.scale, records
                )
            )
        if exact.scale < 1.0 and "below_one" not in self._warned:
            self._warned.add("below_one")
            what = "The loss scale fell below 1: gradients are being scaled down, not up"
            _warn(self._collapse_text(what, exact.scale, records))
        if streak >= _SKIP_WARNING and "streak" not in self._warned:
            self._warned.add("streak")
            what = f"{streak} consecutive iterations were skipped"
            _warn(self._collapse_text(what, exact.scale, records))

    def _collapse_text(self, what: str, scale: float, records: list[OptimizerRecord]) -> str:
        optimizers = [r.optimizer() for r in records if r.optimizer is not None]
        alive = [o for o in optimizers if o is not None]
        diagnosis = diagnostics.diagnose_optimizers(alive) if alive else None
        streak = self._mirror.exact.overflow_streak if self._mirror.exact else 0
        return diagnostics.collapse_message(what, scale, streak, diagnosis)

    def _end_iteration(self) -> None:
        self._phases.clear()
        self._per_device_cache.clear()
        self._inv_scale = None

    # ------------------------------------------------------------------ telemetry

    def last_step_skipped(self, optimizer: _Optimizer | None = None) -> bool:
        """Whether the last ``step`` of ``optimizer`` was skipped (any optimizer of the
        current or, after ``update()``, the last iteration when ``optimizer`` is None).

        Correct for fused optimizers too, whose ``step`` is always called. Use it to advance
        LR schedulers, EMAs and step counters only on real updates. ``False`` when disabled.

        Raises:
            ScalerStateError: that optimizer (or any) has not been stepped yet.

        Host sync: one (use :meth:`last_step_skipped_async` to avoid it).
        """
        return bool(self.last_step_skipped_async(optimizer).item())

    def last_step_skipped_async(self, optimizer: _Optimizer | None = None) -> torch.Tensor:
        """:meth:`last_step_skipped` as a 0-d bool tensor on the scale's device.

        Host sync: none.
        """
        if not self._enabled:
            return torch.zeros((), dtype=torch.bool)
        if optimizer is not None:
            flag = self._step_skips.get(id(optimizer))
        else:
            current = [self._step_skips[id(o)] for o in self._stepped_this_iteration()]
            flag = torch.stack(current).any() if current else self._last_iteration_skip
        if flag is None:
            raise ScalerStateError(
                "last_step_skipped() was called before any scaler.step() of "
                + ("this optimizer." if optimizer is not None else "any optimizer.")
            )
        return flag

    def _stepped_this_iteration(self) -> list[_Optimizer]:
        refs = [r.optimizer for r in self._phases.records() if r.optimizer is not None]
        return [o for o in (ref() for ref in refs) if o is not None]

    def stats(self) -> ScalerStats:
        """Counters since creation (or since the loaded state dict) and the current scale.

        Host sync: one, when the scale lives on an accelerator (the counters stay on the
        device until read).
        """
        if not self._enabled or self._state is None:
            p = self._pending
            it, skipped = p.counters[0], p.counters[1]
            scale = p.scale if self._enabled else 1.0
            return ScalerStats(
                iterations=it,
                steps_taken=it - skipped,
                steps_skipped=skipped,
                consecutive_skips=p.overflow_streak,
                growths=p.counters[2],
                backoffs=p.counters[3],
                scale=scale,
            )
        return read_stats(self._state)

    def history(self) -> list[HistoryEntry]:
        """The last ``history`` iterations (constructor argument), oldest first.

        Host sync: one.
        """
        return self._history.entries()

    def register_update_hook(
        self, hook: Callable[[GradScaler, UpdateEvent], None]
    ) -> RemovableHandle:
        """Call ``hook(scaler, event)`` after every rule update (not after ``update(new_scale)``).

        The event holds device tensors; the hook decides whether to read them.

        Returns:
            A handle whose ``remove()`` unregisters the hook.

        Host sync: none (unless the hook reads the tensors).
        """
        if not callable(hook):
            raise ConfigError(f"hook must be callable, got {type(hook).__name__}.")
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def diagnose(self, optimizer: _Optimizer | None = None) -> diagnostics.Diagnosis:
        """Parameters of ``optimizer`` (default: those stepped or unscaled this iteration)
        whose grads are inf/NaN or missing, by name when the optimizer knows names.

        Host sync: one.
        """
        if optimizer is not None:
            return diagnostics.diagnose_optimizers([optimizer])
        return diagnostics.diagnose_optimizers(self._stepped_this_iteration())

    # ------------------------------------------------------------------ getters / setters

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled).

        Host sync: one, when the scale lives on an accelerator.
        """
        if not self._enabled:
            return 1.0
        if self._state is None:
            return self._pending.scale
        return self._mirror.resync(self._state).scale

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor, or None before the first ``scale()``. Host sync: none."""
        return None if self._state is None else self._state.scale

    def _get_growth_tracker(self) -> int:
        """Clean iterations since the last growth or overflow. Host sync: one off the CPU."""
        if not self._enabled:
            return 0
        if self._state is None:
            return self._pending.growth_tracker
        return self._mirror.resync(self._state).growth_tracker

    @property
    def _scale(self) -> torch.Tensor | None:
        return self._get_scale_async()

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        return None if self._state is None else self._state.growth_tracker

    def get_growth_factor(self) -> float:
        """The growth factor. Host sync: none."""
        return self._config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1). Raises ConfigError otherwise. Host sync: none."""
        self._config = self._config.with_(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor. Host sync: none."""
        return self._config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1)). Raises ConfigError otherwise. Host sync: none."""
        self._config = self._config.with_(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval. Host sync: none."""
        return self._config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an int >= 1). Raises ConfigError otherwise. Host sync: none."""
        self._config = self._config.with_(growth_interval=new_interval)

    def is_enabled(self) -> bool:
        """Whether this scaler scales. Host sync: none."""
        return self._enabled

    @property
    def config(self) -> ScalerConfig:
        """The current settings (frozen; change them through the setters). Host sync: none."""
        return self._config

    # ------------------------------------------------------------------ state

    def _current_values(self) -> LoadedState:
        if self._state is None:
            return self._pending
        exact = self._mirror.resync(self._state)
        return LoadedState(
            self._config,
            exact.scale,
            exact.growth_tracker,
            exact.overflow_streak,
            [int(c) for c in self._state.counters.tolist()],
        )

    def state_dict(self) -> dict[str, Any]:
        """torch's five keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) plus mixprec's own; ``{}`` when disabled.

        Loads into ``torch.amp.GradScaler`` too (torch ignores the extra keys). Call it after
        ``update()``.

        Host sync: one, when the scale lives on an accelerator.
        """
        if not self._enabled:
            return {}
        return export_state(self._config, self._current_values())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or from ``torch.amp.GradScaler``.

        Everything is validated before anything changes. Works before the first ``scale()``
        (the values seed the tensors created then). A no-op when disabled.

        Raises:
            ConfigError: empty dict, missing keys, or values of the wrong type or range.

        Host sync: none (values are written into existing tensors with ``fill_``).
        """
        if not self._enabled:
            return
        loaded = parse_state_dict(state_dict, self._config)
        self._config = loaded.config
        self._pending = loaded
        self._mirror = HostMirror(loaded.scale, loaded.growth_tracker, loaded.overflow_streak)
        self._iteration = loaded.counters[0]
        if self._state is not None:
            self._state.scale.fill_(loaded.scale)
            self._state.growth_tracker.fill_(loaded.growth_tracker)
            self._state.overflow_streak.fill_(loaded.overflow_streak)
            self._state.counters.copy_(torch.tensor(loaded.counters, dtype=torch.int64))
        self._end_iteration()

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled and len(self._phases):
            raise ScalerStateError(
                "A GradScaler can only be pickled or copied at the beginning of an iteration or "
                "after update(); this one is mid-iteration (an optimizer was unscaled or "
                "stepped). Call scaler.update() first."
            )
        values = self._current_values() if self._enabled else self._pending
        state = dict(self.__dict__)
        state.update(_state=None, _pending=values, _per_device_cache={}, _inv_scale=None)
        # Hooks may be lambdas and the skip flags are keyed by object ids of this process.
        state.update(_hooks={}, _step_skips={}, _last_iteration_skip=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
