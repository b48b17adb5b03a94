"""Numerical edge cases, each run with torch.amp.GradScaler('cpu') beside mixprec.

Where torch is right, mixprec must match it bit for bit; where torch is wrong (the scale reaching
0, an overflow created by the unscale multiply), the test asserts both behaviours, so a change in
torch shows up here.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

import pytest
import torch

import mixprec
from mixprec._src.scaling.config import FP32_MAX, FP32_TINY
from mixprec.errors import ScaleCollapseWarning

# Every test runs on the CPU's path and on the path a CUDA user takes (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("scaler_path")

FP32_SMALLEST_SUBNORMAL = 2.0**-149


def both(**kwargs: Any) -> dict[str, Any]:
    return {
        "torch": torch.amp.GradScaler("cpu", **kwargs),
        "mixprec": mixprec.GradScaler(**kwargs),
    }


def one_iteration(
    scaler: Any,
    grad: list[float],
    dtype: torch.dtype = torch.float32,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
) -> tuple[torch.Tensor, bool]:
    """Scale a dummy loss, then put ``grad * scale`` (computed in fp64) in the param's grad.

    Returns the parameter after the step and whether it moved.
    """
    param = torch.nn.Parameter(torch.ones(len(grad), dtype=dtype))
    opt = (optimizer or (lambda ps: torch.optim.SGD(ps, lr=1.0)))([param])
    scaler.scale(param.sum()).backward()  # creates the scale on the CPU
    scale = scaler._get_scale_async().double()
    with torch.no_grad():
        param.grad.copy_((torch.tensor(grad, dtype=torch.float64) * scale).to(dtype))
    before = param.detach().clone()
    scaler.step(opt)
    scaler.update()
    return param.detach(), not torch.equal(before, param)


def is_f32(value: float) -> bool:
    return struct.unpack("f", struct.pack("f", value))[0] == value


def test_growth_at_fp32_max_is_refused_and_stays_finite() -> None:
    for start in (2.0**127, FP32_MAX):
        scalers = both(init_scale=start, growth_interval=1)
        for name, scaler in scalers.items():
            for _ in range(3):
                one_iteration(scaler, [1e-36, 1e-36])
            assert scaler.get_scale() == start, name  # x2 would be inf: growth refused
            assert scaler._get_growth_tracker() == 0, name  # and the tracker still resets
        assert scalers["mixprec"].state_dict()["scale"] == scalers["torch"].state_dict()["scale"]


def test_scale_at_the_floor_stays_there_torch_reaches_zero() -> None:
    scalers = both(init_scale=FP32_TINY, growth_interval=1)
    inf = [math.inf]
    with pytest.warns(ScaleCollapseWarning, match="below 1"):
        for _ in range(30):
            for scaler in scalers.values():
                one_iteration(scaler, inf)
    assert scalers["mixprec"].get_scale() == FP32_TINY  # never subnormal, never 0
    assert scalers["torch"].get_scale() == 0.0  # 2**-126 halved 24 times: subnormal, then 0
    # With a scale of 0 every scaled grad is 0, and torch's 1/scale is inf: 0 * inf = NaN
    # after the check (which tests the input), so the step runs and the parameters turn NaN.
    param, _ = one_iteration(scalers["torch"], [1.0])
    assert torch.isnan(param).all()
    param, moved = one_iteration(scalers["mixprec"], [1.0])
    assert moved and torch.equal(param, torch.zeros(1))  # 1 - lr * 1.0


def test_min_scale_is_a_hard_floor_under_overflow() -> None:
    scaler = mixprec.GradScaler(init_scale=4.0, min_scale=1.0, growth_interval=1)
    for _ in range(5):
        one_iteration(scaler, [math.nan])
    assert scaler.get_scale() == 1.0
    assert scaler.stats().steps_skipped == 5


def test_backoff_products_stay_normal_float32() -> None:
    scaler = mixprec.GradScaler(init_scale=3.0 * 2.0**-120, backoff_factor=0.3)
    seen = []
    with pytest.warns(ScaleCollapseWarning):
        for _ in range(8):
            one_iteration(scaler, [math.inf])
            seen.append(scaler.get_scale())
    assert all(is_f32(s) and s >= FP32_TINY for s in seen)
    assert seen[-1] == FP32_TINY


def test_zero_grads_are_clean_iterations() -> None:
    scalers = both(init_scale=2.0**10, growth_interval=2)
    results = {}
    for name, scaler in scalers.items():
        for _ in range(4):
            param, _ = one_iteration(scaler, [0.0, 0.0, -0.0])
        results[name] = (scaler.get_scale(), param)
    assert results["mixprec"][0] == results["torch"][0] == 2.0**12
    assert torch.equal(results["mixprec"][1], results["torch"][1])
    assert scalers["mixprec"].stats().steps_skipped == 0


@pytest.mark.parametrize(
    ("value", "overflow"),
    [(1.5, False), (1e300, False), (math.inf, True), (-math.inf, True), (math.nan, True)],
)
def test_fp64_grads(value: float, overflow: bool) -> None:
    """fp64 grads are unscaled in fp64; 1e300 is finite there (no overflow for an fp64 model)."""
    params = {}
    for name, scaler in both(init_scale=2.0**16).items():
        param, moved = one_iteration(scaler, [value, 1.0], dtype=torch.float64)
        assert moved is not overflow, name
        params[name] = param
    assert torch.equal(params["mixprec"], params["torch"])


def test_denormal_grads_are_finite_and_unscaled_like_torch() -> None:
    grads = {}
    tiny = torch.tensor([FP32_SMALLEST_SUBNORMAL, 1e-40, -3e-39, FP32_TINY])
    for name, scaler in both(init_scale=2.0**-4).items():
        param = torch.nn.Parameter(torch.zeros(4))
        opt = torch.optim.SGD([param], lr=1.0)
        scaler.scale(param.sum()).backward()
        with torch.no_grad():
            param.grad.copy_(tiny)
        if name == "mixprec":
            with pytest.warns(ScaleCollapseWarning):  # the scale is below 1: say so
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
        else:
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        grads[name] = param.grad.clone()
        assert torch.all(torch.isfinite(param.grad))
        assert scaler.get_scale() == 2.0**-4  # clean iteration, no backoff
    assert torch.equal(grads["mixprec"], grads["torch"])
    assert torch.equal(grads["mixprec"], (tiny.double() * 16).float())


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adam"])
def test_overflow_created_by_the_unscale_multiply(fused: bool) -> None:
    """scale 0.5: a grad of 3e38 is finite, but 3e38 / 0.5 is not. torch misses it."""
    grad = [3e38 / 0.5, 1.0]  # one_iteration multiplies it by the scale: 3e38 in the grad

    def make(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
        if fused:
            return torch.optim.Adam(ps, lr=0.1, fused=True)
        return torch.optim.SGD(ps, lr=1.0)

    results = {}
    for name, scaler in both(init_scale=0.5, growth_interval=100).items():
        if name == "mixprec":
            with pytest.warns(ScaleCollapseWarning, match="below 1"):
                results[name] = one_iteration(scaler, grad, optimizer=make)
        else:
            results[name] = one_iteration(scaler, grad, optimizer=make)
        results[name] += (scaler.get_scale(),)
    param, moved, scale = results["mixprec"]
    assert not moved and scale == 0.25  # detected: step skipped, scale backed off
    assert torch.equal(param, torch.ones(2))
    param, moved, scale = results["torch"]
    assert moved and scale == 0.5  # missed: the step ran on an inf gradient
    assert not torch.all(torch.isfinite(param))


@pytest.mark.parametrize("how", ["set_growth_interval", "load_state_dict"])
def test_tracker_beyond_a_shortened_interval_grows_torch_never_does(how: str) -> None:
    """torch's kernel grows when ``tracker + 1 == interval``: past it, never again, silently."""
    scales: dict[str, list[float]] = {}
    for name, scaler in both(init_scale=8.0, growth_interval=10).items():
        for _ in range(6):
            one_iteration(scaler, [1.0])  # tracker 6
        if how == "set_growth_interval":
            scaler.set_growth_interval(3)
        else:
            scaler.load_state_dict({**scaler.state_dict(), "growth_interval": 3})
        scales[name] = [one_iteration(scaler, [1.0]) and scaler.get_scale() for _ in range(7)]
    assert scales["torch"] == [8.0] * 7
    assert scales["mixprec"] == [16.0, 16.0, 16.0, 32.0, 32.0, 32.0, 64.0]
