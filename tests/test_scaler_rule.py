"""The update rule: against torch's kernel, against a tiny reference, and scripted trajectories.

The rule is written once (``rule.next_scale``) and run on Python numbers (the host view, compiled
by ``rule.host_rule``) and on device tensors (the general device form); torch's
``_amp_update_scale_`` is the third form the device path uses with torch's settings. All three
are held to the same reference here, and the compiled host form to the rule run primitive by
primitive on Python numbers.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec import ScalerConfig
from mixprec._src.scaling.config import FP32_TINY, to_f32
from mixprec._src.scaling.rule import (
    DEVICE,
    Ops,
    Tensors,
    Values,
    _advance,
    advance_tensors_,
    host_rule,
    next_scale,
)

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
        streak, tracker = streak + 1, 0
        if streak >= cfg.hysteresis:
            scale = to_f32(scale * cfg.backoff_factor)
    else:
        streak, tracker = 0, tracker + 1
        if tracker == cfg.growth_interval:
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
    """With hysteresis 1 the tensor-op rule is bit-identical to torch's ``_amp_update_scale_``."""
    cfg = ScalerConfig(
        init_scale=scale, growth_factor=growth, backoff_factor=backoff, growth_interval=interval
    )
    ours = Tensors.create(Values(scale), CPU)
    t_scale = torch.full((), scale)
    t_tracker = torch.zeros((), dtype=torch.int32)
    for flag in sequence:
        found = torch.tensor(flag)
        new = next_scale(
            ours.scale, ours.growth_tracker, ours.overflow_streak, found != 0, cfg, DEVICE
        )
        ours.scale.copy_(new[0])
        ours.growth_tracker.copy_(new[1])
        ours.overflow_streak.copy_(new[2])
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


@settings(max_examples=150, deadline=None)
@given(cfg=bounded_configs(), sequence=st.lists(flags, min_size=1, max_size=16))
def test_device_rule_and_host_mirror_equal_reference(
    cfg: ScalerConfig, sequence: list[float]
) -> None:
    scale, low, high = cfg.init_scale, cfg.min_scale, cfg.max_scale
    state = Tensors.create(Values(scale), CPU)
    host = Values(scale)
    expected = (scale, 0, 0)
    for flag in sequence:
        overflow = flag != 0 or math.isnan(flag)
        advance_tensors_(state, torch.tensor(flag), cfg)
        host = host_rule(cfg)(host, overflow)
        expected = _reference(*expected, overflow, cfg)
        got = (state.scale.item(), state.growth_tracker.item(), state.overflow_streak.item())
        assert got == expected == (host.scale, host.growth_tracker, host.overflow_streak)
        assert state.read() == host  # the counters too, and read() is exact
        assert (low or FP32_TINY) <= got[0] <= (high or 3.5e38)
        # powers of two stay exact powers of two with power-of-two factors
        if (
            math.log2(scale).is_integer()
            and math.log2(cfg.growth_factor).is_integer()
            and math.log2(cfg.backoff_factor).is_integer()
        ):
            assert math.log2(got[0]).is_integer()


def _trajectory(cfg: ScalerConfig, sequence: str) -> list[tuple[float, int, int]]:
    state = Tensors.create(Values(cfg.init_scale), CPU)
    out = []
    for ch in sequence:
        advance_tensors_(state, torch.tensor(1.0 if ch == "x" else 0.0), cfg)
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


# The primitives on Python numbers, called one by one: what the compiled host rule must equal.
INTERPRETED = Ops(
    where=lambda c, a, b: a if c else b,
    both=operator.and_,
    either=operator.or_,
    negate=operator.not_,
    at_least=operator.ge,
    minimum=min,
    maximum=max,
    isfinite=math.isfinite,
    wide=float,
    f32=to_f32,
)


@settings(max_examples=150, deadline=None)
@given(
    cfg=bounded_configs(intervals=st.sampled_from([1, 2, 3, 2**31 - 1, 2**40])),
    start=st.tuples(st.sampled_from([0, 1, 2**31 - 2, 2**31 - 1]), st.integers(0, 3)),
    sequence=st.lists(st.booleans(), min_size=1, max_size=16),
)
def test_compiled_host_rule_equals_the_rule_run_primitive_by_primitive(
    cfg: ScalerConfig, start: tuple[int, int], sequence: list[bool]
) -> None:
    compiled = host_rule(cfg)
    values = interpreted = Values(cfg.init_scale, start[0], start[1], (5, 1, 2, 3))
    for overflow in sequence:
        values = compiled(values, overflow)
        interpreted = _advance(interpreted, overflow, cfg, INTERPRETED)
        assert values == interpreted
        assert [type(v) for v in values[:3]] == [float, int, int]
    assert host_rule(cfg) is compiled  # compiled once per configuration


def test_the_compiled_rule_shows_its_source() -> None:
    source: str = host_rule(ScalerConfig(growth_interval=7)).source  # type: ignore[attr-defined]
    assert " >= 7\n" in source  # numbers appear as literals
    assert "to_f32" in source and "def advance(values, overflow):" in source


def test_a_branch_on_a_traced_value_is_refused() -> None:
    """A Python ``if`` on a traced value would bake one outcome into the compiled rule."""

    def branching(scale: Any, tracker: Any, streak: Any, overflow: Any, *rest: Any) -> Any:
        if overflow:
            return scale, tracker, streak
        return scale, tracker, streak

    from mixprec._src.scaling import rule

    saved = rule.next_scale
    rule.next_scale = branching  # type: ignore[assignment]
    try:
        with pytest.raises(TypeError, match=r"ops\.where"):
            host_rule.__wrapped__(ScalerConfig(growth_interval=11))
    finally:
        rule.next_scale = saved
