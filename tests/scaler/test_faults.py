"""Faults: an exception anywhere in an iteration leaves the scaler usable for the next one.

The documented recovery (docs/reliability.md): in the ``except``, call
``scaler.reset_iteration()`` to skip the batch (scale, tracker and counters untouched) or
``scaler.update()`` to count it, and zero the gradients. A run that recovers this way is compared
bit for bit with a run that never saw the faulty batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from mixprec.errors import MissingGradError, ScalerStateError

ITERATIONS = 6
FAULT_AT = 3
SETTINGS = {"init_scale": 2.0**8, "growth_interval": 2}


class Boom(Exception):
    """The fault injected by the tests."""


class FlakySGD(torch.optim.SGD):
    fail = False

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.fail:
            raise Boom("optimizer.step failed")
        return super().step(closure)


class FlakyAdam(torch.optim.Adam):
    """A fused optimizer: mixprec hands it ``grad_scale``/``found_inf`` as attributes."""

    fail = False
    seen: tuple[bool, bool] | None = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.fail:
            self.seen = (hasattr(self, "grad_scale"), hasattr(self, "found_inf"))
            raise Boom("fused optimizer.step failed")
        return super().step(closure)


def make(fused: bool) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = (
        FlakyAdam(model.parameters(), lr=1e-2, fused=True)
        if fused
        else FlakySGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    return model, opt


def batch(it: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(it))


def loss_of(model: nn.Module, it: int) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return model(batch(it)).float().pow(2).mean()


def iteration(model: nn.Module, opt: Any, scaler: mixprec.GradScaler, it: int) -> None:
    scaler.scale(loss_of(model, it)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def reference(fused: bool, skip: int | None) -> tuple[list[float], list[torch.Tensor]]:
    """The run that never saw batch ``skip``."""
    model, opt = make(fused)
    scaler = mixprec.GradScaler(**SETTINGS)
    scales = []
    for it in range(ITERATIONS):
        if it != skip:
            iteration(model, opt, scaler, it)
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


Fault = Callable[[nn.Module, Any, mixprec.GradScaler, int], None]


def fault_in_step(model: nn.Module, opt: Any, scaler: mixprec.GradScaler, it: int) -> None:
    opt.fail = True
    try:
        iteration(model, opt, scaler, it)
    finally:
        opt.fail = False


def fault_in_loss(model: nn.Module, opt: Any, scaler: mixprec.GradScaler, it: int) -> None:
    scaler.scale(loss_of(model, it))  # scaled, but the loss computation then fails
    raise Boom("loss failed")


def fault_in_backward(model: nn.Module, opt: Any, scaler: mixprec.GradScaler, it: int) -> None:
    class Explode(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            raise Boom("backward failed")

    scaler.scale(Explode.apply(loss_of(model, it))).backward()


def fault_after_unscale(model: nn.Module, opt: Any, scaler: mixprec.GradScaler, it: int) -> None:
    scaler.scale(loss_of(model, it)).backward()
    scaler.unscale_(opt)
    raise Boom("clipping failed")


FAULTS: dict[str, Fault] = {
    "optimizer.step": fault_in_step,
    "loss": fault_in_loss,
    "backward": fault_in_backward,
    "between unscale_ and step": fault_after_unscale,
}


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adam"])
@pytest.mark.parametrize("where", list(FAULTS))
def test_reset_iteration_skips_the_faulty_batch_exactly(where: str, fused: bool) -> None:
    model, opt = make(fused)
    scaler = mixprec.GradScaler(**SETTINGS)
    scales = []
    for it in range(ITERATIONS):
        if it == FAULT_AT:
            with pytest.raises(Boom):
                FAULTS[where](model, opt, scaler, it)
            scaler.reset_iteration()
            opt.zero_grad(set_to_none=True)
        else:
            iteration(model, opt, scaler, it)
        scales.append(scaler.get_scale())
    expected_scales, expected_params = reference(fused, skip=FAULT_AT)
    assert scales == expected_scales
    if where == "optimizer.step" and fused:
        # The attributes are removed even though the step raised (a ``finally``).
        assert opt.seen == (True, True)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    for p, q in zip(model.parameters(), expected_params, strict=True):
        assert torch.equal(p, q)
    assert scaler.stats().iterations == ITERATIONS - 1


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adam"])
def test_update_after_a_failed_step_counts_the_iteration(fused: bool) -> None:
    model, opt = make(fused)
    scaler = mixprec.GradScaler(**SETTINGS)
    with pytest.raises(Boom):
        fault_in_step(model, opt, scaler, 0)
    scaler.update()  # the documented alternative: the iteration counts (as a clean one)
    opt.zero_grad(set_to_none=True)
    assert scaler.stats().iterations == 1
    assert scaler._get_growth_tracker() == 1
    iteration(model, opt, scaler, 1)
    assert scaler.get_scale() == 2 * SETTINGS["init_scale"]


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adam"])
def test_without_recovery_a_failed_step_is_refused_loudly(fused: bool) -> None:
    """No silent misuse: the next step asks for update() instead of stepping scaled grads."""
    model, opt = make(fused)
    scaler = mixprec.GradScaler(**SETTINGS)
    with pytest.raises(Boom):
        fault_in_step(model, opt, scaler, 0)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss_of(model, 1)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ScalerStateError, match=r"step\(\) has already been called.*update\(\)"):
        scaler.step(opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_exception_in_an_update_hook_leaves_a_consistent_scaler() -> None:
    model, opt = make(False)
    scaler = mixprec.GradScaler(**SETTINGS)

    def hook(s: Any, event: Any) -> None:
        raise Boom("hook failed")

    handle = scaler.register_update_hook(hook)
    scaler.scale(loss_of(model, 0)).backward()
    scaler.step(opt)
    with pytest.raises(Boom):
        scaler.update()
    # The rule was applied before the hook ran, and the iteration ended.
    assert scaler.stats().iterations == 1 and scaler._get_growth_tracker() == 1
    assert scaler._phases.peek(opt) is None
    handle.remove()
    opt.zero_grad(set_to_none=True)
    iteration(model, opt, scaler, 1)
    assert scaler.get_scale() == 2 * SETTINGS["init_scale"]


@pytest.mark.filterwarnings("ignore::mixprec.errors.ScaleCollapseWarning")
@pytest.mark.parametrize("init_scale", [2.0**8, 0.5])  # below 1: the fused path unscales first
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adam"])
def test_step_without_grads_can_be_retried_after_backward(fused: bool, init_scale: float) -> None:
    model, opt = make(fused)
    scaler = mixprec.GradScaler(**{**SETTINGS, "init_scale": init_scale})
    scaler.scale(loss_of(model, 0))  # forgot backward()
    with pytest.raises(MissingGradError, match=r"has a \.grad"):
        scaler.step(opt)
    scaler.scale(loss_of(model, 0)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)  # the grads are unscaled and checked now: a real step
    scaler.update()
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert scaler.get_scale() == init_scale
    assert scaler.stats().steps_taken == 1


def test_reset_iteration_is_a_no_op_between_iterations_and_when_disabled() -> None:
    scaler = mixprec.GradScaler(**SETTINGS)
    scaler.reset_iteration()
    model, opt = make(False)
    iteration(model, opt, scaler, 0)
    state = scaler.state_dict()
    scaler.reset_iteration()
    assert scaler.state_dict() == state
    mixprec.GradScaler(enabled=False).reset_iteration()


def test_a_closure_that_raises_mid_step_leaves_params_and_scaler_usable() -> None:
    """LBFGS evaluates its closure several times; the second evaluation fails here."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=3)
    scaler = mixprec.GradScaler(**SETTINGS)
    calls = [0]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        calls[0] += 1
        if calls[0] == 2:
            raise Boom("loss failed inside the closure")
        loss = model(batch(0)).pow(2).mean()
        scaler.scale(loss).backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(Boom):
        scaler.step(opt, closure)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    scaler.reset_iteration()
    calls[0] = 10  # no more failures
    scaler.step(opt, closure)
    scaler.update()
    assert scaler.stats().iterations == 1 and scaler.stats().steps_skipped == 0
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
