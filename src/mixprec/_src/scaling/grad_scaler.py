"""GradScaler: one class composed of the parts it owns; it sequences the iteration.

The parts (``docs/internals.md`` draws them): the frozen settings (:mod:`.args`), where the scale
is (:mod:`.state`), where a phase changes (:mod:`.phases`), telemetry (:mod:`.telemetry`) and
distributed agreement (:mod:`mixprec._src.dist`). :mod:`.engine` runs the passes over gradients
on them and is the internal interface of closures (:mod:`.closure`) and ``JoinableScaler``
(:mod:`.join`). Three groups of methods are defined in their own modules and bound into the
class by name (no inheritance): clipping (:mod:`.clipping`), the signals users read
(:mod:`.signals`) and torch's private API (:mod:`.compat`); they too use only the engine.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from mixprec._src import optim
from mixprec._src.dist.agree import validate_group
from mixprec._src.dist.state import DistState
from mixprec._src.scaling import clipping, compat, signals
from mixprec._src.scaling.args import SIGNATURE, Settings, settings_from
from mixprec._src.scaling.checkpoint import export_state, parse_state_dict
from mixprec._src.scaling.closure import step_with_closure
from mixprec._src.scaling.config import ScalerConfig, validated_new_scale
from mixprec._src.scaling.engine import Engine, sum_on
from mixprec._src.scaling.nested import scale_nested
from mixprec._src.scaling.phases import PhaseTable
from mixprec._src.scaling.rule import Values
from mixprec._src.scaling.state import ScaleState
from mixprec._src.scaling.telemetry import Telemetry
from mixprec.errors import MixprecWarning

_Optimizer = torch.optim.Optimizer


class GradScaler:
    """Dynamic loss scaling, a drop-in for ``torch.amp.GradScaler`` on every device.

    Both call forms work: torch 2's ``GradScaler("cuda", init_scale, growth_factor,
    backoff_factor, growth_interval, enabled)`` and torch.cuda.amp 1.5's
    ``GradScaler(init_scale, growth_factor, backoff_factor, growth_interval, enabled)``. The scale
    lives on the device of the first tensor passed to :meth:`scale`, whatever ``device`` says, so
    a scaler never disables itself. With default settings the scale trajectory, the skipped
    steps and the parameters are bit-identical to torch's.

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
        process_group: keyword-only ``torch.distributed`` group the grads are sharded over
            (FSDP1, ZeRO, tensor parallel): its ranks agree on every skip with one MAX
            all-reduce per optimizer per iteration, and ``clip_grad_norm_`` sums norms over it.
            Not for DDP (replicated grads); detected for DTensor (FSDP2) grads. Not saved in
            state dicts or pickles. See ``docs/distributed.md``.

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
        settings, group = settings_from(args, kwargs)
        self._settings: Settings = settings
        self._state = ScaleState(Values(settings.config.init_scale))
        self._phases = PhaseTable()
        self._telemetry = Telemetry(settings.history)
        self._dist = DistState(validate_group(group))
        self._engine = Engine(self._state, self._phases, self._telemetry, self._dist)

    # ------------------------------------------------------------------ the iteration

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or a nested list/tuple/dict/iterable of tensors, by the scale.

        Lists, tuples (named ones too), dicts, ``OrderedDict``/``defaultdict`` and mappings that
        rebuild from a dict keep their type; other iterables come back as a list. The scale is
        created on the device of the first tensor met; outputs on other devices are multiplied
        by a copy on their own device. As in torch, a 0-d fp16 loss becomes fp32.

        Raises:
            ConfigError: a leaf is not a tensor, or a container cannot be rebuilt (its type
                named), or the first tensor is on the meta device.

        Host sync: none.
        """
        if not self._settings.enabled:
            return outputs
        scaled = scale_nested(outputs, self._state.scale_on)
        self._phases.note_scaled(scaled)
        return scaled

    def unscale_(self, optimizer: _Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and check them for inf/NaN.

        Call it between ``backward`` and ``step`` when the gradients must be read or changed
        unscaled; ``step`` does it otherwise. At most once per optimizer per iteration. Overflow
        created by the division itself (possible when the scale is below 1) is detected too,
        which torch misses.

        Raises:
            ScalerStateError: no ``scale()`` yet, or already unscaled/stepped this iteration.
            LowPrecisionGradError: some gradients are fp16 (names them; nothing is changed).

        Host sync: none.
        """
        if not self._settings.enabled:
            return
        self._engine.require_scale("unscale_")
        self._engine.unscale(optimizer, self._phases.begin_unscale(optimizer))

    def step(self, optimizer: _Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` already did) and step, unless a grad is inf/NaN.

        Returns ``optimizer.step(*args, **kwargs)``'s value, or ``None`` when skipped. A skipped
        step leaves the parameters and the optimizer's state as they were. Optimizers that
        declare ``_step_supports_amp_scaling`` (torch's ``fused=True`` ones) get ``grad_scale``/
        ``found_inf`` and skip inside their kernel, as with torch (on their first step mixprec
        reads the flag once, so that a skipped first step cannot leave half-created state); those
        written to torch's legacy contract get ``grad_scaler=self``. A closure (``step(opt,
        closure)`` or ``closure=``), which must call ``scaler.scale(loss).backward()``, may be
        evaluated several times (LBFGS, SAM): each evaluation is unscaled and checked, and an
        overflow skips the step and restores everything (``docs/closures.md``).

        Raises:
            ScalerStateError: no ``scale()`` yet, or stepped twice.
            MissingGradError: none of the optimizer's parameters has a grad (names them).

        Host sync: one per call for non-fused optimizers (to decide whether to call
        ``optimizer.step``); none for fused ones after their first step; with a closure, one per
        closure evaluation.
        """
        if not self._settings.enabled:
            return optimizer.step(*args, **kwargs)
        call = optim.split_closure(args, kwargs) if args or kwargs else None
        if call is not None:
            return step_with_closure(self._engine, optimizer, call)
        if self._state.scale is None:
            self._engine.require_scale("step")
        record = self._phases.begin_step(optimizer)
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._engine.step_plain(optimizer, record, args, kwargs)
        if not optim.takes_grad_scaler(optimizer):
            return self._engine.step_fused(optimizer, record, args, kwargs)
        warnings.warn(
            "GradScaler is going to stop passing itself as a keyword argument to the passed "
            "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
            "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
            FutureWarning,
            stacklevel=2,
        )
        return self._engine.step_legacy(optimizer, record, args, kwargs, self)

    def update(self, new_scale: float | torch.Tensor | _Optimizer | None = None) -> None:
        """End the iteration: back off after an overflow, grow after enough clean iterations.

        ``new_scale`` may be a number or a 1-element tensor to set the scale directly (rounded to
        float32; the growth tracker is kept), or, as some pages on ``GradScaler.update`` write it,
        the optimizer that stepped: ``update(optimizer)`` is ``update()`` after checking that this
        optimizer was unscaled or stepped since the last update.

        Raises:
            MissingGradError: nothing was unscaled or stepped since the last update.
            ScalerStateError: no ``scale()`` yet.
            ConfigError: ``new_scale`` is not finite and within the bounds, or a bad tensor.

        Host sync: none (one when ``max_consecutive_skips`` is set and the iteration's outcome
        is not already known on the host, i.e. fused optimizers off the CPU; one when
        ``new_scale`` is a tensor off the host, whose value is read to check it).
        """
        if not self._settings.enabled:
            return
        if new_scale is not None and hasattr(new_scale, "param_groups"):
            self._phases.require_touched(new_scale)
            new_scale = None
        scale = self._state.scale
        if scale is None:
            scale = self._engine.require_scale("update")
        config = self._settings.config
        if new_scale is not None:  # a bad value raises before the iteration ends (as torch)
            value = validated_new_scale(new_scale, scale.device, config)
        try:
            if new_scale is not None:
                self._state.set_scale(value)
                return
            flags, overflow = self._phases.outcome()
            total = sum_on(flags, scale.device)
            telemetry, state = self._telemetry, self._state
            keep = telemetry.history.capacity > 0
            used, iteration, values = state.advance(total, overflow, config, keep)
            limit = config.max_consecutive_skips
            if values is None and limit is not None:
                values = state.values()  # the limit must be checked now: read the device
            telemetry.after_update(
                self, iteration, scale, used, total, values, limit, self._phases.stepped
            )
        finally:
            self._end_iteration()

    def reset_iteration(self) -> None:
        """Abandon the current iteration after an exception: every optimizer is READY again.

        Use it when something raised between ``scale()`` and ``update()`` and the batch is to be
        skipped: the scale, the growth tracker and the counters are left as they were. The
        gradients are not touched: zero them before the next backward. Call ``update()`` instead
        to count the iteration. A no-op between iterations and when disabled.

        Example:
            >>> import torch, mixprec
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = mixprec.GradScaler()
            >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            >>> scaler.unscale_(opt)
            >>> scaler.reset_iteration()  # e.g. in an ``except`` around the training step
            >>> opt.zero_grad()

        Host sync: none.
        """
        self._end_iteration()

    def _end_iteration(self) -> None:
        self._dist.end_iteration()
        self._phases.end_iteration()

    # ------------------------------------------------------------------ bound from their modules

    # Clipping (mixprec._src.scaling.clipping): unscale fused with clipping.
    clip_grad_norm_ = clipping.clip_grad_norm_
    clip_grad_value_ = clipping.clip_grad_value_
    # Signals (mixprec._src.scaling.signals): skips, counters, history, hooks, diagnosis.
    last_step_skipped = signals.last_step_skipped
    last_step_skipped_async = signals.last_step_skipped_async
    stats = signals.stats
    history = signals.history
    register_update_hook = signals.register_update_hook
    diagnose = signals.diagnose
    # torch.amp.GradScaler's private methods that libraries call (mixprec._src.scaling.compat).
    _lazy_init_scale_growth_tracker = compat.lazy_init_scale_growth_tracker
    _get_scale_async = compat.get_scale_async
    _get_growth_tracker = compat.get_growth_tracker
    _check_inf_per_device = compat.check_inf_per_device
    _found_inf_per_device = compat.found_inf_per_device
    _scale = property(compat.get_scale_async)
    _growth_tracker = property(compat.growth_tracker_tensor)

    # ------------------------------------------------------------------ settings

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled).

        Host sync: one, when the scale lives on an accelerator and the host lost track of it.
        """
        return self._state.values().scale if self._settings.enabled else 1.0

    def get_growth_factor(self) -> float:
        """The growth factor. Host sync: none."""
        return self._settings.config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1). Raises ConfigError otherwise. Host sync: none."""
        self._settings = self._settings.with_config(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor. Host sync: none."""
        return self._settings.config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1)). Raises ConfigError otherwise. Host sync: none."""
        self._settings = self._settings.with_config(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval. Host sync: none."""
        return self._settings.config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an int >= 1). Raises ConfigError otherwise.

        Clean iterations already counted beyond the new interval are capped at one short of it,
        so the scale grows at the next clean iteration (torch's kernel compares with ``==`` and
        would not grow again for 2**31 iterations).

        Host sync: none.
        """
        self._settings = self._settings.with_config(growth_interval=new_interval)
        self._state.cap_tracker(self._settings.config.growth_interval - 1)

    def is_enabled(self) -> bool:
        """Whether this scaler scales. Host sync: none."""
        return self._settings.enabled

    @property
    def config(self) -> ScalerConfig:
        """The current settings (frozen; change them through the setters). Host sync: none."""
        return self._settings.config

    @property
    def process_group(self) -> Any:
        """The group the grads are sharded over, whose ranks agree on every skip (None: no
        agreement unless the grads are DTensors; DDP needs none). Not saved in state dicts or
        pickles: set it again after unpickling.

        Raises:
            ConfigError: (setter) not None or a ``torch.distributed.ProcessGroup``.

        Host sync: none.
        """
        return self._dist.group

    @process_group.setter
    def process_group(self, group: Any) -> None:
        self._dist.group = validate_group(group)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's five keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) plus mixprec's own; ``{}`` when disabled.

        Loads into ``torch.amp.GradScaler`` too (torch ignores the extra keys).

        Host sync: one, when the scale lives on an accelerator and the host lost track of it.
        """
        if not self._settings.enabled:
            return {}
        return export_state(self._settings.config, self._state.values())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or from ``torch.amp.GradScaler``.

        Everything is validated before anything changes. Works before the first ``scale()``
        (the values go into the tensors created then). A no-op when disabled. A scale outside
        this scaler's bounds (``min_scale``/``max_scale``, the smallest normal float32) is loaded
        as the nearest bound, with a :class:`~mixprec.errors.MixprecWarning` saying so.

        Raises:
            ConfigError: empty dict, missing keys, or values of the wrong type or range (also
                values the scaler's state tensors could not hold).
            ScalerStateError: called mid-iteration: ``scale()`` was called, or an optimizer was
                unscaled or stepped, with the current scale (torch silently mixes the two). Call
                ``update()`` or :meth:`reset_iteration` first.

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
        return {
            "settings": self._settings,
            "values": self._state.values(),
            "telemetry": self._telemetry,  # without hooks and skip flags (see Telemetry)
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._settings = state["settings"]
        self._state = ScaleState(state["values"])
        self._phases = PhaseTable()
        self._telemetry = state["telemetry"]
        self._dist = DistState()  # process groups do not pickle; set it again
        self._engine = Engine(self._state, self._phases, self._telemetry, self._dist)
