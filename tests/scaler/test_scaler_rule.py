"""The update rule: against torch's kernel, against a tiny reference, and scripted trajectories.

The rule is written out twice (``rule.advance`` on Python numbers, the host form; ``rule.advance_``
on device tensors, the device form, which runs torch's ``_amp_update_scale_`` with torch's settings
and ``rule.general_advance_`` otherwise). Both are held to the same reference here, at the int32
edge of the growth interval too, and the general device form to torch's kernel.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec import ScalerConfig
from mixprec._src.scaling.config import FP32_TINY, INT32_MAX, to_f32
from mixprec._src.scaling.rule import Tensors, Values, advance, advance_, general_advance_

CPU = torch.device("cpu")

# Overflow flags as torch sees them: 0 is clean; anything else (NaN and negatives too) overflows.
flags = st.sampled_from([0.0, 0.0, 0.0, 1.0, 2.0, math.nan, -1.0])
scales = st.floats(min_value=FP32_TINY, max_value=3.0e38).map(to_f32)
factors = st.sampled_from([1.5, 2.0, 4.0, 16.0])
backoffs = st.sampled_from([0.5, 0.25, 0.9, 0.1])


def _reference(
    scale: float, tracker: int, streak: int, overflow: bool, cfg: ScalerConfig
) -> tuple[float, int, int]:
    """The documented rule, written as plainly as possible with numpy-free float32 rounding."""
    if overflow:
        streak, tracker = min(streak + 1, INT32_MAX), 0
        if streak >= cfg.hysteresis:
            scale = to_f32(scale * cfg.backoff_factor)
    else:
        streak, tracker = 0, min(tracker + 1, INT32_MAX)  # the counts saturate at the int32 maximum
        if tracker >= cfg.growth_interval:
            tracker = 0
            grown = to_f32(scale * cfg.growth_factor)
            if cfg.max_scale is not None and grown > cfg.max_scale:
                grown = cfg.max_scale
            if math.isfinite(grown):
                scale = grown
    scale = max(scale, cfg.min_scale if cfg.min_scale is not None else FP32_TINY)
    if cfg.max_scale is not None:
        scale = min(scale, cfg.max_scale)
    return scale, tracker, streak


@settings(max_examples=150, deadline=None)
@given(
    scale=scales,
    growth=factors,
    backoff=backoffs,
    interval=st.integers(1, 4),
    sequence=st.lists(flags, min_size=1, max_size=12),
)
def test_general_rule_equals_torch_kernel(
    scale: float, growth: float, backoff: float, interval: int, sequence: list[float]
) -> None:
    """With hysteresis 1 the general device form is bit-identical to ``_amp_update_scale_``."""
    cfg = ScalerConfig(
        init_scale=scale, growth_factor=growth, backoff_factor=backoff, growth_interval=interval
    )
    ours = Tensors.create(Values(scale), CPU)
    t_scale = torch.full((), scale)
    t_tracker = torch.zeros((), dtype=torch.int32)
    for flag in sequence:
        found = torch.tensor(flag)
        general_advance_(ours, found, cfg)
        torch._amp_update_scale_(t_scale, t_tracker, found, growth, backoff, interval)
        if t_scale.item() < FP32_TINY:  # torch has no floor; ours clamps later
            return
        assert ours.scale.item() == t_scale.item()
        assert ours.growth_tracker.item() == t_tracker.item()


SHORT_INTERVALS = st.integers(1, 4)


@st.composite
def bounded_configs(draw: Any, intervals: Any = SHORT_INTERVALS) -> ScalerConfig:
    """Every setting of the rule, with bounds, and a first scale within them."""
    low = draw(st.sampled_from([None, 1.0, 2.0**-10]))
    high = draw(st.sampled_from([None, 2.0**20]))
    return ScalerConfig(
        init_scale=min(max(draw(scales), low or 0.0), high or math.inf),
        growth_factor=draw(factors),
        backoff_factor=draw(backoffs),
        growth_interval=draw(intervals),
        hysteresis=draw(st.integers(1, 3)),
        min_scale=low,
        max_scale=high,
    )


def _check_both_forms(cfg: ScalerConfig, start: Values, sequence: list[float]) -> None:
    """Host form, device form and general device form step by step against the reference."""
    device, general = Tensors.create(start, CPU), Tensors.create(start, CPU)
    host = start
    expected = start[:3]
    for flag in sequence:
        overflow = flag != 0 or math.isnan(flag)
        advance_(device, torch.tensor(flag), cfg)
        general_advance_(general, torch.tensor(flag), cfg)
        before, host = host, advance(host, overflow, cfg)
        expected = _reference(*expected, overflow, cfg)
        assert host[:3] == expected
        assert [type(v) for v in host[:3]] == [float, int, int]
        grew, shrank = expected[0] > before.scale, expected[0] < before.scale
        steps = (1, overflow, grew, shrank)
        assert list(host.counters) == [a + b for a, b in zip(before.counters, steps, strict=True)]
        assert (device.scale.item(), device.growth_tracker.item()) == expected[:2]
        assert general.read()[:3] == expected
        assert (cfg.min_scale or FP32_TINY) <= expected[0] <= (cfg.max_scale or 3.5e38)


@settings(max_examples=150, deadline=None)
@given(cfg=bounded_configs(), sequence=st.lists(flags, min_size=1, max_size=16))
def test_device_and_host_forms_equal_reference(cfg: ScalerConfig, sequence: list[float]) -> None:
    _check_both_forms(cfg, Values(cfg.init_scale), sequence)
    scale = cfg.init_scale
    if (
        math.log2(scale).is_integer()
        and math.log2(cfg.growth_factor).is_integer()
        and math.log2(cfg.backoff_factor).is_integer()
    ):  # powers of two stay exact powers of two with power-of-two factors
        host = Values(scale)
        for flag in sequence:
            host = advance(host, flag != 0 or math.isnan(flag), cfg)
            assert math.log2(host.scale).is_integer()


@settings(max_examples=150, deadline=None)
@given(
    cfg=bounded_configs(intervals=st.sampled_from([1, 2, 3, 2**31 - 1, 2**40])),
    start=st.tuples(*[st.sampled_from([0, 1, 2, 2**31 - 2, 2**31 - 1])] * 2),
    sequence=st.lists(st.sampled_from([0.0, 0.0, 1.0]), min_size=1, max_size=16),
)
def test_both_forms_at_the_int32_edge_of_the_interval(
    cfg: ScalerConfig, start: tuple[int, int], sequence: list[float]
) -> None:
    """Counts near the int32 maximum saturate; an interval beyond it never ends. (The tracker
    starts below the interval, as a loaded checkpoint's does: torch's kernel assumes it.)"""
    tracker = min(start[0], cfg.growth_interval - 1)
    _check_both_forms(cfg, Values(cfg.init_scale, tracker, start[1], (5, 1, 2, 3)), sequence)


def _trajectory(cfg: ScalerConfig, sequence: str) -> list[tuple[float, int, int]]:
    state = Tensors.create(Values(cfg.init_scale), CPU)
    out = []
    for ch in sequence:
        advance_(state, torch.tensor(1.0 if ch == "x" else 0.0), cfg)
        out.append((state.scale.item(), state.growth_tracker.item(), state.overflow_streak.item()))
    return out


def test_scripted_hysteresis() -> None:
    cfg = ScalerConfig(init_scale=64.0, growth_interval=2, hysteresis=2)
    assert _trajectory(cfg, "x.xxx..") == [
        (64.0, 0, 1),  # first overflow: skipped, no backoff yet
        (64.0, 1, 0),  # clean: the overflow count resets
        (64.0, 0, 1),
        (32.0, 0, 2),  # second consecutive overflow backs off
        (16.0, 0, 3),  # and every one after it
        (16.0, 1, 0),
        (32.0, 0, 0),  # growth after the interval
    ]


def test_scripted_bounds_and_floor() -> None:
    bounded = ScalerConfig(init_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=8.0)
    assert [s for s, _, _ in _trajectory(bounded, "..xxx")] == [8.0, 8.0, 4.0, 2.0, 2.0]
    floor = ScalerConfig(init_scale=2.0**-120, backoff_factor=0.5)
    assert [s for s, _, _ in _trajectory(floor, "xxxxxxxxx")][-1] == FP32_TINY


def test_growth_never_reaches_inf() -> None:
    cfg = ScalerConfig(init_scale=3.0e38, growth_interval=1)
    assert _trajectory(cfg, "...") == [(to_f32(3.0e38), 0, 0)] * 3


def test_lowering_the_growth_interval_caps_the_tracker() -> None:
    import mixprec

    scaler = mixprec.GradScaler(init_scale=4.0, growth_interval=10)
    param = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=0.0)
    for _ in range(6):
        scaler.scale(param.sum()).backward()
        scaler.step(opt)
        scaler.update()
    scaler.set_growth_interval(3)
    assert scaler._get_growth_tracker() == 2
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 8.0
