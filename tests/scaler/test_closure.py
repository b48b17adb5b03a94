"""``scaler.step(optimizer, closure)``: LBFGS and SAM, with overflows injected into evaluations.

The oracle for exactness is the same optimizer without a scaler: with an fp32 model and a
power-of-two scale, scaling and unscaling are exact, so the trajectories must be bit-identical,
and a skipped step must leave a run bit-identical to one where that step never happened.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mixprec
from mixprec.errors import LowPrecisionGradError, ScalerStateError

torch.manual_seed(0)
A = torch.randn(64, 8)
B = A @ torch.randn(8, 1) + 0.01 * torch.randn(64, 1)


def _model() -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(8, 1)


def _lbfgs(model: nn.Module) -> torch.optim.LBFGS:
    return torch.optim.LBFGS(model.parameters(), lr=1, max_iter=6, line_search_fn="strong_wolfe")


def _closure(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: Any,
    fp16: bool = False,
    inject_at: int | None = None,
    return_scaled: bool = False,
) -> Callable[[], torch.Tensor]:
    calls = [0]

    def closure() -> torch.Tensor:
        calls[0] += 1
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = F.mse_loss(model(A).float(), B)
        if calls[0] == inject_at:
            loss = loss * float("inf")
        if scaler is None:
            loss.backward()
            return loss
        scaled = scaler.scale(loss)
        scaled.backward()
        return scaled if return_scaled else loss

    return closure


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    params = [p.detach().clone() for p in model.parameters()]
    return params, copy.deepcopy(opt.state_dict())


def _assert_same(a: Any, b: Any) -> None:
    """Deep, bit-for-bit equality of nested containers of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _train_lbfgs(steps: int, scaler: Any, skip_step: int | None = None, **kw: Any) -> Any:
    model = _model()
    opt = _lbfgs(model)
    losses = []
    for i in range(steps):
        inject = 2 if i == skip_step else None
        closure = _closure(model, opt, scaler, inject_at=inject, **kw)
        losses.append(scaler.step(opt, closure) if scaler else opt.step(closure))
        if scaler is not None:
            scaler.update()
    return model, opt, losses


def test_lbfgs_fp32_is_bit_identical_to_lbfgs_without_scaler() -> None:
    plain, plain_opt, plain_losses = _train_lbfgs(3, None)
    scaled, scaled_opt, losses = _train_lbfgs(3, mixprec.GradScaler())
    _assert_same(_snapshot(plain, plain_opt), _snapshot(scaled, scaled_opt))
    _assert_same(plain_losses, losses)  # the optimizer saw (and returned) the unscaled loss


def test_lbfgs_sees_the_unscaled_loss_when_the_closure_returns_the_scaled_one() -> None:
    plain, plain_opt, plain_losses = _train_lbfgs(2, None)
    scaled, scaled_opt, losses = _train_lbfgs(2, mixprec.GradScaler(), return_scaled=True)
    _assert_same(_snapshot(plain, plain_opt), _snapshot(scaled, scaled_opt))
    _assert_same(plain_losses, losses)


def test_overflow_in_an_evaluation_skips_and_restores_everything_bit_for_bit() -> None:
    scaler = mixprec.GradScaler()
    model, opt, _ = _train_lbfgs(1, scaler)
    before = _snapshot(model, opt)
    scale = scaler.get_scale()
    closure = _closure(model, opt, scaler, inject_at=3)  # the 3rd evaluation overflows
    assert scaler.step(opt, closure) is None
    _assert_same(before, _snapshot(model, opt))
    assert scaler.last_step_skipped(opt)
    scaler.update()
    assert scaler.get_scale() == scale * 0.5


def test_a_skipped_closure_step_leaves_the_run_as_if_it_never_happened() -> None:
    reference, ref_opt, _ = _train_lbfgs(3, mixprec.GradScaler())
    scaler = mixprec.GradScaler()
    skipped, skipped_opt, losses = _train_lbfgs(4, scaler, skip_step=1)
    assert losses[1] is None
    assert scaler.stats().steps_skipped == 1
    _assert_same(_snapshot(reference, ref_opt), _snapshot(skipped, skipped_opt))


@pytest.mark.parametrize("keyword", [False, True])
def test_lbfgs_fp16_autocast_converges_like_fp32(keyword: bool) -> None:
    def final_loss(fp16: bool) -> float:
        model = _model()
        opt = _lbfgs(model)
        scaler = mixprec.GradScaler()
        for _ in range(4):
            closure = _closure(model, opt, scaler, fp16=fp16)
            _ = scaler.step(opt, closure=closure) if keyword else scaler.step(opt, closure)
            scaler.update()
        with torch.no_grad():
            return F.mse_loss(model(A), B).item()

    fp32, fp16 = final_loss(False), final_loss(True)
    start = F.mse_loss(_model()(A), B).item()
    assert fp32 < 1e-3 * start
    assert fp16 == pytest.approx(fp32, rel=0.05, abs=1e-5)


def test_closure_that_the_optimizer_never_calls_is_an_error_and_changes_nothing() -> None:
    class IgnoresClosure(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            return super().step()

    model = _model()
    opt = IgnoresClosure(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler()
    scaler.scale(F.mse_loss(model(A), B)).backward()
    before = _snapshot(model, opt)
    with pytest.raises(ScalerStateError, match="did not call the closure"):
        scaler.step(opt, _closure(model, opt, scaler))
    _assert_same(before, _snapshot(model, opt))


def test_fp16_parameters_in_a_closure_raise_the_low_precision_error_and_restore() -> None:
    model = _model().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler()
    before = [p.detach().clone() for p in model.parameters()]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(A.half()).float(), B)
        scaler.scale(loss).backward()
        return loss

    with pytest.raises(LowPrecisionGradError, match="MasterWeights"):
        scaler.step(opt, closure)
    _assert_same(before, [p.detach() for p in model.parameters()])


def test_closure_may_unscale_itself_to_clip() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler()
    norms: list[float] = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(A), B)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        return loss

    scaler.step(opt, closure)
    scaler.update()
    reference = _model()
    F.mse_loss(reference(A), B).backward()
    expected = nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    assert norms == [float(expected)]  # unscaled once, not twice


# ------------------------------------------------------------------ SAM (two passes per step)


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as in davda54/sam: ``step(closure)`` takes the first pass's
    gradients from before the call and evaluates the closure for the second pass."""

    def __init__(self, params: Any, base: type[torch.optim.Optimizer], rho: float, **kw: Any):
        super().__init__(params, dict(rho=rho, **kw))
        self.base_optimizer = base(self.param_groups, **kw)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["e_w"] = e_w = p.grad * (group["rho"] / (norm + 1e-12))
                    p.add_(e_w)
        self.zero_grad()

    @torch.no_grad()
    def second_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if "e_w" in self.state[p]:
                    p.sub_(self.state[p]["e_w"])
        self.base_optimizer.step()

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.first_step()
        with torch.enable_grad():
            closure()
        self.second_step()


def _sam_run(scaler: Any, steps: int, inject: dict[int, int] | None = None, fp16: bool = False):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9)
    inject = inject or {}

    def loss_of(step: int, pass_: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = F.mse_loss(model(A).float(), B)
        return loss * float("inf") if inject.get(step) == pass_ else loss

    losses = []
    for step in range(steps):
        loss = loss_of(step, 1)
        losses.append(loss.item())
        if scaler is None:
            loss.backward()
            opt.step(lambda s=step: loss_of(s, 2).backward())
            opt.zero_grad()
            continue
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # the first pass's grads, unscaled before SAM perturbs with them

        def closure(s: int = step) -> torch.Tensor:
            second = loss_of(s, 2)
            scaler.scale(second).backward()
            return second

        scaler.step(opt, closure)
        scaler.update()
        opt.zero_grad()
    return model, opt, losses


def _sam_state(model: nn.Module, opt: SAM) -> Any:
    return _snapshot(model, opt), copy.deepcopy(opt.base_optimizer.state_dict())


def test_sam_fp32_is_bit_identical_to_sam_without_scaler() -> None:
    plain = _sam_run(None, 3)
    scaled = _sam_run(mixprec.GradScaler(), 3)
    _assert_same(_sam_state(*plain[:2]), _sam_state(*scaled[:2]))


@pytest.mark.parametrize("pass_", [1, 2])
def test_sam_overflow_in_either_pass_skips_the_whole_step(pass_: int) -> None:
    reference = _sam_run(mixprec.GradScaler(), 3)
    scaler = mixprec.GradScaler()
    skipped = _sam_run(scaler, 4, inject={1: pass_})
    stats = scaler.stats()
    assert (stats.steps_skipped, stats.backoffs, stats.iterations) == (1, 1, 4)
    assert scaler.get_scale() == 2.0**15
    # the perturbation of the first pass, SAM's own state and the base optimizer's momentum:
    # all restored, so the run continues exactly as if the step had not happened
    _assert_same(_sam_state(*reference[:2]), _sam_state(*skipped[:2]))


def test_sam_under_fp16_autocast_trains() -> None:
    _, _, losses = _sam_run(mixprec.GradScaler(), 12, inject={3: 2}, fp16=True)
    assert losses[-1] < 0.5 * losses[0]


def test_unscale_twice_without_a_closure_is_still_refused() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler()
    scaler.scale(F.mse_loss(model(A), B)).backward()
    scaler.unscale_(opt)
    with pytest.raises(ScalerStateError, match="already been called"):
        scaler.unscale_(opt)


def test_fused_optimizer_with_a_closure_matches_it_without_scaler() -> None:
    runs = []
    for scaler in (None, mixprec.GradScaler()):
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
        for _ in range(3):
            closure = _closure(model, opt, scaler)
            _ = opt.step(closure) if scaler is None else scaler.step(opt, closure)
            if scaler is not None:
                scaler.update()
        runs.append(_snapshot(model, opt))
    _assert_same(*runs)


def test_closure_that_never_scales_is_an_error_naming_the_fix() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _snapshot(model, opt)
    with pytest.raises(ScalerStateError, match=r"scaler\.scale\(loss\)\.backward\(\)"):
        mixprec.GradScaler().step(opt, _closure(model, opt, None))
    _assert_same(before, _snapshot(model, opt))


class SAMBothPasses(SAM):
    """A SAM whose ``step(closure)`` evaluates the closure for both passes."""

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        with torch.enable_grad():
            closure()
        super().step(closure)


def _sam_both_passes(scaler: Any, steps: int, inject: dict[int, int]) -> Any:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = SAMBothPasses(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9)
    for step in range(steps):
        calls = [0]

        def closure(step: int = step, calls: list[int] = calls) -> torch.Tensor:
            calls[0] += 1
            opt.zero_grad()
            loss = F.mse_loss(model(A), B)
            loss = loss * float("inf") if inject.get(step) == calls[0] else loss
            (loss if scaler is None else scaler.scale(loss)).backward()
            return loss

        if scaler is None:
            opt.step(closure)
        else:
            scaler.step(opt, closure)
            scaler.update()
    return model, opt


@pytest.mark.parametrize("pass_", [1, 2])
def test_sam_that_evaluates_both_passes_needs_no_unscale(pass_: int) -> None:
    plain = _sam_both_passes(None, 3, {})
    scaler = mixprec.GradScaler()
    skipped = _sam_both_passes(scaler, 4, {1: pass_})
    assert scaler.stats().steps_skipped == 1
    _assert_same(_sam_state(*plain), _sam_state(*skipped))
