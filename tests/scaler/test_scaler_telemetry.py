"""Issue 4: skip signal, counters, history, hooks, collapse warnings and errors, diagnose()."""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch
from torch import nn

import mixprec


def _setup(fused: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    return model, opt


def _iteration(
    scaler: mixprec.GradScaler, model: nn.Module, opt: torch.optim.Optimizer, inject: bool = False
) -> None:
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    if inject:
        model[1].weight.grad[0, 0] = math.inf
    scaler.step(opt)


@pytest.mark.parametrize("fused", [False, True])
def test_scheduler_and_ema_advance_only_on_real_updates(fused: bool) -> None:
    model, opt = _setup(fused)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ema = [p.detach().clone() for p in model.parameters()]
    scaler = mixprec.GradScaler()
    overflows = {0, 3, 4}
    real_updates = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for it in range(7):
            _iteration(scaler, model, opt, inject=it in overflows)
            skipped = scaler.last_step_skipped()
            assert skipped == (it in overflows)
            assert bool(scaler.last_step_skipped_async(opt)) == skipped
            if not skipped:
                real_updates += 1
                sched.step()
                for e, p in zip(ema, model.parameters(), strict=True):
                    e.mul_(0.9).add_(p.detach(), alpha=0.1)
            scaler.update()
            assert scaler.last_step_skipped() == skipped  # still answers after update()
    assert real_updates == 4
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**4)
    stats = scaler.stats()
    assert (stats.iterations, stats.steps_taken, stats.steps_skipped) == (7, 4, 3)
    assert (stats.backoffs, stats.growths, stats.consecutive_skips) == (3, 0, 0)
    assert stats.scale == 65536.0 / 8


def test_last_step_skipped_before_any_step_raises() -> None:
    with pytest.raises(mixprec.errors.ScalerStateError, match=r"before any scaler\.step"):
        mixprec.GradScaler().last_step_skipped()


def test_history_is_bounded_and_records_the_scale_used() -> None:
    model, opt = _setup()
    scaler = mixprec.GradScaler(init_scale=8.0, growth_interval=1, history=3)
    for it in range(5):
        _iteration(scaler, model, opt, inject=it == 3)
        scaler.update()
    assert [(h.iteration, h.scale, h.skipped) for h in scaler.history()] == [
        (3, 32.0, False),
        (4, 64.0, True),
        (5, 32.0, False),
    ]
    assert mixprec.GradScaler().history() == []


def test_update_hook_gets_device_tensors_and_can_be_removed() -> None:
    model, opt = _setup()
    scaler = mixprec.GradScaler()
    events: list[mixprec.types.UpdateEvent] = []
    handle = scaler.register_update_hook(lambda s, e: events.append(e))
    _iteration(scaler, model, opt, inject=True)
    scaler.update()
    assert len(events) == 1 and events[0].iteration == 1
    assert isinstance(events[0].skipped, torch.Tensor) and bool(events[0].skipped)
    handle.remove()
    _iteration(scaler, model, opt)
    scaler.update()
    assert len(events) == 1
    with pytest.raises(mixprec.errors.ConfigError):
        scaler.register_update_hook("not callable")  # type: ignore[arg-type]


def test_scale_below_one_warns_once_and_names_parameters() -> None:
    model, opt = _setup()
    opt = torch.optim.AdamW(model.named_parameters(), lr=0.01)
    scaler = mixprec.GradScaler(init_scale=2.0)
    with pytest.warns(mixprec.errors.ScaleCollapseWarning) as record:
        for _ in range(4):
            _iteration(scaler, model, opt, inject=True)
            scaler.update()
    texts = [str(w.message) for w in record]
    assert len(texts) == 1
    assert "fell below 1" in texts[0] and "scale 0.5" in texts[0]
    assert "1.weight" in texts[0] and "bf16" in texts[0]


def test_many_consecutive_skips_warn() -> None:
    model, opt = _setup()
    scaler = mixprec.GradScaler(min_scale=1.0, init_scale=1.0)
    with pytest.warns(mixprec.errors.ScaleCollapseWarning, match="50 consecutive iterations"):
        for _ in range(50):
            _iteration(scaler, model, opt, inject=True)
            scaler.update()
    assert scaler.get_scale() == 1.0  # held at min_scale


def test_max_consecutive_skips_raises_and_scaler_stays_usable() -> None:
    model, opt = _setup()
    opt = torch.optim.AdamW(model.named_parameters(), lr=0.01)
    scaler = mixprec.GradScaler(max_consecutive_skips=3, min_scale=1024.0, init_scale=1024.0)
    for _ in range(2):
        _iteration(scaler, model, opt, inject=True)
        scaler.update()
    _iteration(scaler, model, opt, inject=True)
    with pytest.raises(mixprec.errors.ScaleCollapseError, match="3 consecutive iterations") as info:
        scaler.update()
    assert "1.weight" in str(info.value) and isinstance(info.value, RuntimeError)
    _iteration(scaler, model, opt)  # the next iteration works
    scaler.update()
    assert scaler.stats().consecutive_skips == 0


def test_diagnose_names_non_finite_and_missing_grads() -> None:
    model, _ = _setup()
    extra = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([*model.named_parameters(), ("extra", extra)], lr=0.1)
    scaler = mixprec.GradScaler()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    model[0].bias.grad[1] = math.nan
    report = scaler.diagnose(opt)
    assert report.non_finite == ["0.bias"] and report.missing == ["extra"]
    assert "0.bias" in str(report) and not report.healthy


def test_state_dict_carries_new_fields_and_loads_torch_dicts() -> None:
    model, opt = _setup()
    scaler = mixprec.GradScaler(hysteresis=2, max_scale=2.0**20)
    for it in range(3):
        _iteration(scaler, model, opt, inject=it > 0)
        scaler.update()
    sd = scaler.state_dict()
    assert sd["hysteresis"] == 2 and sd["max_scale"] == 2.0**20 and sd["_overflow_streak"] == 2
    fresh = mixprec.GradScaler()
    fresh.load_state_dict(sd)
    assert fresh.state_dict() == sd and fresh.stats() == scaler.stats()
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.state_dict() == sd
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(sd)  # torch ignores the extra keys
    plain = mixprec.GradScaler(hysteresis=3)
    plain.load_state_dict(theirs.state_dict())  # no mixprec keys: settings stay
    assert plain.config.hysteresis == 3 and plain.get_scale() == sd["scale"]
