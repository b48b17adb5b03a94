"""The scale update as a pure function of 0-d device tensors.

Nothing here reads a value back to the host: every decision is a tensor operation, so an update
costs a handful of tiny kernels and no synchronisation.

With ``hysteresis == 1`` and no ``max_scale`` the rule is torch's own ``_amp_update_scale_`` kernel,
so the trajectory is bit-identical to ``torch.amp.GradScaler``; the only difference is the floor
(the scale never goes below the smallest normal float32, where torch's reaches 0 and every later
step is skipped silently). The general rule reproduces the same arithmetic (products in float64,
rounded once to float32), which the property tests check against the torch kernel.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import torch

from mixprec._src.scaling.config import ScalerConfig

_TORCH_KERNEL_DEVICES = {"cpu", "cuda"}


@dataclass
class ScaleState:
    """The scaler's device-side state: four 0-d tensors on one device.

    Attributes:
        scale: the current scale (float32).
        growth_tracker: clean iterations since the last growth or overflow (int32).
        overflow_streak: consecutive overflowing iterations (int32); drives hysteresis.
        counters: int64 vector ``[iterations, overflows, growths, backoffs]``.
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    overflow_streak: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def create(
        cls,
        scale: float,
        growth_tracker: int,
        overflow_streak: int,
        device: torch.device,
        counters: list[int] | None = None,
    ) -> ScaleState:
        """Fresh state tensors on ``device``."""
        return cls(
            scale=torch.full((), scale, dtype=torch.float32, device=device),
            growth_tracker=torch.full((), growth_tracker, dtype=torch.int32, device=device),
            overflow_streak=torch.full((), overflow_streak, dtype=torch.int32, device=device),
            counters=torch.tensor(counters or [0, 0, 0, 0], dtype=torch.int64, device=device),
        )


def update_scale_(
    state: ScaleState, found_inf: torch.Tensor, config: ScalerConfig, *, clamp: bool = True
) -> torch.Tensor:
    """Advance ``state`` by one iteration in place; return the scale it had before (a copy).

    Args:
        state: the tensors to update (all on one device).
        found_inf: 0-d float32 tensor on that device; any non-zero value (NaN included) is an
            overflow.
        config: growth, backoff, interval, bounds and hysteresis.
        clamp: apply the bounds; the caller may pass False when it knows that the torch rule
            cannot leave them (no ``max_scale`` and a scale far above the floor).

    Host sync: none.
    """
    old_scale = state.scale.clone()
    overflow = found_inf != 0
    if config.is_torch_rule and state.scale.device.type in _TORCH_KERNEL_DEVICES:
        torch._amp_update_scale_(
            state.scale,
            state.growth_tracker,
            found_inf,
            config.growth_factor,
            config.backoff_factor,
            config.growth_interval,
        )
        state.overflow_streak.add_(1).mul_(overflow)
    else:
        _general_update_(state, overflow, config)
    if clamp or not config.is_torch_rule:
        state.scale.clamp_(min=config.floor, max=config.max_scale)
    grew, backed_off = state.scale > old_scale, state.scale < old_scale
    state.counters.add_(torch.stack([torch.ones_like(overflow), overflow, grew, backed_off]))
    return old_scale


def _general_update_(state: ScaleState, overflow: torch.Tensor, config: ScalerConfig) -> None:
    """Bounds- and hysteresis-aware rule, written with device tensor ops only."""
    streak = torch.where(overflow, state.overflow_streak + 1, 0)
    back_off = overflow & (streak >= config.hysteresis)
    tracker = state.growth_tracker + 1
    at_interval = ~overflow & (tracker >= config.growth_interval)
    scale64 = state.scale.double()
    grown = (scale64 * config.growth_factor).float()
    if config.max_scale is not None:
        grown = grown.clamp(max=config.max_scale)
    grows = at_interval & torch.isfinite(grown)
    shrunk = (scale64 * config.backoff_factor).float()
    new_scale = torch.where(back_off, shrunk, torch.where(grows, grown, state.scale))
    state.scale.copy_(new_scale)
    state.growth_tracker.copy_(torch.where(overflow | at_interval, 0, tracker))
    state.overflow_streak.copy_(streak)


def to_f32(value: float) -> float:
    """Round a Python float to the nearest float32 (inf when it overflows)."""
    try:
        return float(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


@dataclass(frozen=True)
class HostScale:
    """The same rule on Python numbers: the host's exact mirror of :class:`ScaleState`.

    Used where the host already knows whether an iteration overflowed (a non-fused ``step``
    reads that anyway), so the scaler can decide things about the scale without reading it.
    """

    scale: float
    growth_tracker: int
    overflow_streak: int

    def advance(self, overflow: bool, config: ScalerConfig) -> HostScale:
        """The state after one iteration; identical arithmetic to :func:`update_scale_`."""
        scale, tracker, streak = self.scale, self.growth_tracker, self.overflow_streak
        if overflow:
            streak += 1
            tracker = 0
            if streak >= config.hysteresis:
                scale = to_f32(scale * config.backoff_factor)
        else:
            streak = 0
            tracker += 1
            if tracker >= config.growth_interval:
                tracker = 0
                grown = to_f32(scale * config.growth_factor)
                if config.max_scale is not None:
                    grown = min(grown, config.max_scale)
                if math.isfinite(grown):
                    scale = grown
        high = config.max_scale if config.max_scale is not None else math.inf
        return HostScale(min(max(scale, config.floor), high), tracker, streak)


def write_host_update_(state: ScaleState, before: HostScale, after: HostScale) -> None:
    """Store an update computed on the host (:meth:`HostScale.advance`) into ``state``.

    On the CPU this replaces :func:`update_scale_`: the host already knows the outcome, and a
    few ``fill_`` calls cost less than the comparisons the device form needs. Same values, bit
    for bit (the property tests hold the two forms to one reference).

    Host sync: none (meant for CPU tensors).
    """
    state.scale.fill_(after.scale)
    state.growth_tracker.fill_(after.growth_tracker)
    state.overflow_streak.fill_(after.overflow_streak)
    overflow = after.overflow_streak > 0
    delta = (1, int(overflow), int(after.scale > before.scale), int(after.scale < before.scale))
    state.counters.add_(_counter_delta(delta))


@functools.cache
def _counter_delta(delta: tuple[int, int, int, int]) -> torch.Tensor:
    """The few possible per-iteration increments, built once (``torch.tensor`` costs ~9 us)."""
    return torch.tensor(delta, dtype=torch.int64)
