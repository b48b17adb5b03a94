"""The one owner of the scale, the growth tracker, the overflow streak and the counters, on one of
two paths (``docs/internals.md``), chosen when the scale is created:

* the host path (tensors in host memory): the truth is one immutable ``Values``, replaced at each
  update by the host form of the rule; the scale tensor is written when the scale changes;
* the device path (every other device, and the CPU once ``torch.compile`` traced an update): the
  truth is the device tensors, updated by the device form; the host keeps the values as last read
  and a :class:`_Log` of the updates since, and derives the rest when read, by replaying the host
  form (while the host knows every outcome it keeps the values current and logs nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec._src.devices import caps
from mixprec._src.scaling.config import ScalerConfig, to_f32
from mixprec._src.scaling.rule import Tensors, Values, advance, advance_
from mixprec.errors import ConfigError

# Backoff products are rounded to float32; shrinking the bound a little more keeps it a bound.
_ROUNDING_MARGIN = 1.0 - 2.0**-20
# Logged flags are stacked in groups of this many, and so are the stacks: an update dispatches at
# most one extra op, and a long run without reads keeps four bytes per update.
_FOLD = 256
# Every this many unread updates, the scale is copied to the host without waiting: once landed, it
# bounds the scale from below again, so the host rarely has to assume a scale near the floor or
# below 1 (the clamp, and unscaling in a fused step).
_PROBE = 8

Record = Callable[[int, float, bool], None]


class _Log:
    """The device path's updates since the host last read the tensors: their overflow flags,
    oldest first, all under one config (the scaler's setters read the log before a change).

    Updates traced by ``torch.compile`` append to ``traced``, a tensor (a Python container would
    make dynamo recompile at every call), which eager code moves on (:meth:`seal`). ``bound``
    assumes a backoff at every update, unless a probe (a copy of the scale that has landed) tells
    better.
    """

    def __init__(self, bound: float) -> None:
        self.stacks: list[torch.Tensor] = []
        self.flags: list[torch.Tensor] = []
        self.traced: torch.Tensor | None = None
        self.config: ScalerConfig | None = None
        self.count = 0  # updates logged, not counting the traced ones
        self.bound = bound  # the scale is known to be >= this
        self.probe: tuple[int, torch.Tensor, Any] | None = None

    def add(self, found_inf: torch.Tensor, config: ScalerConfig, scale: torch.Tensor) -> None:
        """Log one update, after torch's kernel ran on ``scale`` (at most one op: a fold, or a
        probe sent or read)."""
        self.seal()
        factor = config.backoff_factor * _ROUNDING_MARGIN
        self.config, self.count = config, self.count + 1
        self.bound = max(self.bound * factor, config.floor)
        if len(self.flags) == _FOLD:
            self.stacks.append(torch.stack(self.flags))
            self.flags = []
        elif len(self.stacks) == _FOLD:
            self.stacks = [torch.cat(self.stacks)]
        elif self.probe is None:
            if self.count % _PROBE == 0:
                copy = scale.to("cpu", non_blocking=True, copy=True)
                self.probe = (self.count, copy, _event(scale))
        elif self.probe[2] is None or self.probe[2].query():  # landed: the scale was copy then
            at, copy, _ = self.probe
            self.bound = max(self.bound, copy.item() * factor ** (self.count - at))
            self.probe = None
        self.flags.append(found_inf)

    def trace(self, found_inf: torch.Tensor, config: ScalerConfig) -> None:
        flag = found_inf.reshape(1)
        self.traced = flag if self.traced is None else torch.cat([self.traced, flag])
        self.config = config

    def seal(self) -> None:
        """Move the traced updates behind the others (eager code only)."""
        if self.traced is not None:
            self.stacks += [torch.stack(self.flags), self.traced] if self.flags else [self.traced]
            self.count += self.traced.numel()
            self.flags, self.traced = [], None

    def replay(self, values: Values, record: Record | None) -> Values:
        """``values`` after every logged update, each reported to ``record``. Host sync: one."""
        self.seal()
        if self.config is None:
            return values
        for flag in torch.cat([*self.stacks, *(f.reshape(1) for f in self.flags)]).tolist():
            before, values = values, advance(values, flag != 0, self.config)
            if record is not None:
                record(values.counters[0], before.scale, flag != 0)
        return values


def _event(tensor: torch.Tensor) -> Any:
    """An event after the work queued on ``tensor``'s device (None on the CPU: copies there have
    landed when issued)."""
    try:
        event = torch.Event(tensor.device)
        event.record()
    except RuntimeError:  # "cpu backend doesn't support events"
        return None
    return event


class ScaleState:
    """The scale, growth tracker, overflow streak and counters, on the host or the device path."""

    def __init__(self, values: Values, record: Record | None = None) -> None:
        self._values = values  # the truth on the host path; on the device path, as last read
        self._tensors: Tensors | None = None
        self._log: _Log | None = None  # the device path's updates since `_values` (None: host)
        self._record = record  # told (number, scale used, skipped) of each update, once known

    @property
    def scale(self) -> torch.Tensor | None:
        """The scale tensor, or None before the first ``scale()``. Host sync: none."""
        return None if self._tensors is None else self._tensors.scale

    @property
    def device(self) -> torch.device:
        """The scale's device (call after the first ``scale()``). Host sync: none."""
        assert self._tensors is not None
        return self._tensors.scale.device

    def materialize(self, device: torch.device) -> Tensors:
        """The tensors, created on ``device`` (choosing the path) if they do not exist yet;
        ConfigError on the meta device. Host sync: none."""
        if self._tensors is None:
            if device.type == "meta":
                raise ConfigError(
                    "scale() got a tensor on the 'meta' device, which holds no data: the scale "
                    "cannot live there. Materialize the model (e.g. model.to_empty(device=...) "
                    "and load its weights) before the first scale()."
                )
            self._tensors = Tensors.create(self._values, device)
            self._choose_path()
        return self._tensors

    def _choose_path(self) -> None:
        assert self._tensors is not None
        host = caps(self._tensors.scale.device).host_memory
        self._log = None if host else _Log(self._values.scale)

    def growth_tracker(self) -> torch.Tensor | None:
        """The growth tracker tensor, current (the host path writes it now), or None before the
        first ``scale()``. Host sync: none."""
        if self._tensors is None:
            return None
        if self._log is None:
            self._tensors.growth_tracker.fill_(self._values.growth_tracker)
        return self._tensors.growth_tracker

    def values(self) -> Values:
        """The exact values. Host sync: one on the device path when there are updates to
        replay."""
        if self.read_pending:
            assert self._log is not None and self._tensors is not None
            self._values = self._log.replay(self._values, self._record)
            self._tensors.overflow_streak.fill_(self._values.overflow_streak)  # (see advance_)
            self._log = _Log(self._values.scale)
        return self._values

    @property
    def read_pending(self) -> bool:
        """Whether :meth:`values` would read the device. Host sync: none."""
        log = self._log
        return log is not None and (log.config is not None or log.traced is not None)

    def scale_on(self, device: torch.device) -> torch.Tensor:
        """The scale on ``device`` (a copy off its own device). Host sync: none."""
        scale = self.scale if self._tensors is not None else self.materialize(device).scale
        assert scale is not None
        return scale if scale.device == device else scale.to(device, non_blocking=True)

    def inv_scale(self) -> torch.Tensor:
        """``float32(1 / float64(scale))``, as torch computes it. Host sync: none."""
        scale = self.scale
        assert scale is not None
        if self._log is None and not torch.compiler.is_compiling():
            inverse = to_f32(1.0 / self._values.scale)
            return torch.full((), inverse, dtype=torch.float32, device=scale.device)
        return scale.to(caps(scale.device).wide_float).reciprocal().float()

    @property
    def may_be_below_one(self) -> bool:
        """True unless the host can prove ``scale >= 1`` (then ``1/scale`` cannot overflow);
        always under ``torch.compile`` (dynamo would guard on the host's numbers). Host sync:
        none."""
        if torch.compiler.is_compiling():
            return True
        return not (self._values.scale if self._log is None else self._log.bound) >= 1.0

    def advance(
        self, found_inf: torch.Tensor, overflow: bool | None, config: ScalerConfig
    ) -> tuple[int, Values | None]:
        """Apply the rule for one iteration, given its combined overflow flag and, when the host
        knows it, its outcome. Returns ``(the number of the update (-1 under torch.compile),
        the values after it if the host knows them without a read)``. Host sync: none."""
        tensors = self._tensors
        assert tensors is not None
        if torch.compiler.is_compiling():
            if self._log is None:  # the host path cannot be traced: the device path from now on
                tensors.write(self._values)
                self._log = _Log(self._values.scale)
            advance_(tensors, found_inf, config)
            self._log.trace(found_inf, config)
            return -1, None
        if self._log is None:
            if overflow is None:  # in host memory: reading the flag costs no sync
                overflow = bool(found_inf.item() != 0)
            return self._known_outcome(overflow, config)
        # The floor clamp is needed only when one backoff could take the scale near it.
        log = self._log
        advance_(
            tensors, found_inf, config, clamp=log.bound * config.backoff_factor < 4 * config.floor
        )
        if overflow is not None and log.config is None:  # a non-fused step read the flag already
            return self._known_outcome(overflow, config)
        log.add(found_inf, config, tensors.scale)
        return self._values.counters[0] + log.count, None

    def _known_outcome(self, overflow: bool, config: ScalerConfig) -> tuple[int, Values]:
        """The host form on the values (the host path, or the device path with nothing unread);
        the scale tensor written when it changes on the host path."""
        before, after = self._values, advance(self._values, overflow, config)
        self._values = after
        if self._log is not None:
            self._log.bound = after.scale
        elif after.scale != before.scale:
            assert self._tensors is not None
            self._tensors.scale.fill_(after.scale)
        if self._record is not None:
            self._record(after.counters[0], before.scale, overflow)
        return after.counters[0], after

    def load(self, values: Values) -> None:
        """Replace every value (a validated checkpoint, ``update(new_scale)``, a shortened
        interval: after :meth:`values`); the path is chosen again. Host sync: none."""
        self._values = values
        if self._tensors is not None:
            self._tensors.write(values)
            self._choose_path()
