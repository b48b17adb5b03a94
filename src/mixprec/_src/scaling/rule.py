"""The scale update rule, written out twice: on Python numbers and on device tensors.

The rule: an overflowing iteration counts towards the overflow streak and resets the growth
tracker; on the ``hysteresis``-th consecutive one the scale is multiplied by ``backoff_factor``.
A clean iteration resets the streak; on the ``growth_interval``-th in a row the scale is
multiplied by ``growth_factor`` (capped at ``max_scale``; refused if not finite) and the tracker
resets (also when the growth was refused, as in torch). Products are taken in float64 and rounded
once to float32, as torch's kernel does; the counts saturate at the int32 maximum (an interval
beyond it never ends). The scale stays within ``[floor, max_scale]``: the floor (the smallest
normal float32, or ``min_scale``) is mixprec's addition, where torch's scale reaches 0 and every
later step is skipped silently.

:func:`advance` is the host form (floats in, floats out, with the counters); :func:`advance_` is
the device form: torch's ``_amp_update_scale_`` where the device has it and the settings are
torch's, plus the floor, else the general form in tensor operations (:func:`general_advance_`).
``tests/scaler/test_scaler_rule.py`` holds both to one reference, and the general form to torch's
kernel.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mixprec._src import torch_compat
from mixprec._src.devices import caps
from mixprec._src.scaling.config import INT32_MAX, ScalerConfig, to_f32


class Values(NamedTuple):
    """The scale (a float32 value) and its companions as Python numbers (immutable)."""

    scale: float
    growth_tracker: int = 0  # clean iterations since the last growth or overflow
    overflow_streak: int = 0  # consecutive overflowing iterations (hysteresis)
    counters: tuple[int, int, int, int] = (0, 0, 0, 0)  # iterations, overflows, growths, backoffs


def advance(values: Values, overflow: bool, config: ScalerConfig) -> Values:
    """The host form: ``values`` after one iteration, counters included."""
    scale, tracker, streak = values.scale, values.growth_tracker, values.overflow_streak
    n, skips, grew, shrank = values.counters
    new = scale
    if overflow:
        tracker, streak = 0, min(streak + 1, INT32_MAX)
        if streak >= config.hysteresis:
            new = max(to_f32(scale * config.backoff_factor), config.floor)
    else:
        tracker, streak = min(tracker + 1, INT32_MAX), 0
        if tracker >= config.growth_interval:
            tracker = 0
            grown = to_f32(scale * config.growth_factor)
            if config.max_scale is not None:
                grown = min(grown, config.max_scale)
            if math.isfinite(grown):
                new = grown
    counts = (n + 1, skips + overflow, grew + (new > scale), shrank + (new < scale))
    return Values(new, tracker, streak, counts)


@dataclass
class Tensors:
    """The scale, growth tracker and overflow streak on a device (0-d float32, int32, int32)."""

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    overflow_streak: torch.Tensor

    @classmethod
    def create(cls, values: Values, device: torch.device) -> Tensors:
        """Fresh tensors holding ``values`` on ``device``. Host sync: none."""
        return cls(
            torch.full((), values.scale, dtype=torch.float32, device=device),
            torch.full((), values.growth_tracker, dtype=torch.int32, device=device),
            torch.full((), values.overflow_streak, dtype=torch.int32, device=device),
        )

    def write(self, values: Values) -> None:
        """Store ``values`` (three ``fill_``). Host sync: none."""
        self.scale.fill_(values.scale)
        self.growth_tracker.fill_(values.growth_tracker)
        self.overflow_streak.fill_(values.overflow_streak)

    def read(self) -> tuple[float, int, int]:
        """``(scale, growth_tracker, overflow_streak)``, exactly (the scale travels as its
        float32 bits). Host sync: one off the host."""
        bits = self.scale.reshape(1).view(torch.int32)
        scale_bits, tracker, streak = torch.cat(
            [bits, self.growth_tracker.reshape(1), self.overflow_streak.reshape(1)]
        ).tolist()
        return struct.unpack("f", struct.pack("i", scale_bits))[0], tracker, streak


def advance_(
    tensors: Tensors, found_inf: torch.Tensor, config: ScalerConfig, *, clamp: bool = True
) -> None:
    """The device form: the rule applied to ``tensors`` in place, ``found_inf`` non-zero (NaN
    included) an overflow; no counters. With torch's kernel the streak tensor is left alone (the
    caller derives it from the flags), and the floor is applied if ``clamp`` (the caller knows
    when one backoff cannot reach it). Host sync: none."""
    if config.is_torch_rule and caps(tensors.scale.device).amp_kernels:
        torch_compat.amp_update_scale_(
            tensors.scale,
            tensors.growth_tracker,
            found_inf,
            config.growth_factor,
            config.backoff_factor,
            config.growth_interval,
        )
        if clamp:
            tensors.scale.clamp_(min=config.floor)
    else:
        general_advance_(tensors, found_inf, config)


def general_advance_(tensors: Tensors, found_inf: torch.Tensor, config: ScalerConfig) -> None:
    """The device form in tensor operations, for every setting and device. Host sync: none."""
    scale = tensors.scale
    overflow = found_inf != 0
    streak = torch.where(overflow, tensors.overflow_streak.clamp(max=INT32_MAX - 1) + 1, 0)
    tracker = torch.where(overflow, 0, tensors.growth_tracker.clamp(max=INT32_MAX - 1) + 1)
    if config.growth_interval > INT32_MAX:  # an int32 count never gets there (and would wrap)
        grows = torch.zeros_like(overflow)
    else:
        grows = ~overflow & (tracker >= config.growth_interval)
    one = torch.ones((), dtype=caps(scale.device).wide_float, device=scale.device)
    factor = torch.where(
        overflow & (streak >= config.hysteresis),
        one * config.backoff_factor,
        torch.where(grows, one * config.growth_factor, one),
    )
    candidate = (scale.to(one.dtype) * factor).float()
    if config.max_scale is not None:
        candidate = candidate.clamp(max=config.max_scale)
    new = torch.where(torch.isfinite(candidate), candidate, scale).clamp(min=config.floor)
    scale.copy_(new if config.max_scale is None else new.clamp(max=config.max_scale))
    tensors.growth_tracker.copy_(torch.where(grows, 0, tracker))
    tensors.overflow_streak.copy_(streak)
