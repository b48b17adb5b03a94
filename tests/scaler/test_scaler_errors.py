"""Every misuse torch detects is detected, with a message that says what happened and the fix."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from torch import nn

import mixprec
from mixprec.errors import LowPrecisionGradError, MissingGradError, ScalerStateError


@pytest.fixture
def setup() -> tuple[nn.Module, torch.optim.Optimizer, mixprec.GradScaler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.named_parameters(), lr=0.1)
    scaler = mixprec.GradScaler()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    return model, opt, scaler


@pytest.mark.parametrize("method", ["unscale_", "step", "update"])
def test_calls_before_scale_say_to_scale_first(method: str) -> None:
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    scaler = mixprec.GradScaler()
    call = getattr(scaler, method)
    with pytest.raises(ScalerStateError, match=rf"{method}\(\) was called before scaler.scale"):
        call() if method == "update" else call(opt)


def test_unscale_twice(setup: tuple) -> None:
    _, opt, scaler = setup
    scaler.unscale_(opt)
    with pytest.raises(ScalerStateError, match=r"already been called.*at most once"):
        scaler.unscale_(opt)


def test_unscale_after_step(setup: tuple) -> None:
    _, opt, scaler = setup
    scaler.step(opt)
    with pytest.raises(ScalerStateError, match=r"after step\(\).*call update\(\) first"):
        scaler.unscale_(opt)


def test_step_twice(setup: tuple) -> None:
    _, opt, scaler = setup
    scaler.step(opt)
    with pytest.raises(ScalerStateError, match=r"step\(\) has already been called"):
        scaler.step(opt)


def test_update_twice(setup: tuple) -> None:
    _, opt, scaler = setup
    scaler.step(opt)
    scaler.update()
    with pytest.raises(MissingGradError, match="no optimizer was unscaled or stepped"):
        scaler.update()


def test_step_with_no_grads_names_the_parameters() -> None:
    model = nn.Linear(2, 2)
    unused = nn.Linear(2, 2)
    opt = torch.optim.SGD(unused.named_parameters(), lr=0.1)
    anonymous = torch.optim.SGD(unused.parameters(), lr=0.1)
    scaler = mixprec.GradScaler()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    with pytest.raises(MissingGradError, match=r"No inf checks.*weight, bias") as info:
        scaler.step(opt)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(MissingGradError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape 2x2\)"):
        scaler.step(anonymous)


def test_fp16_grads_are_named_and_nothing_changes(setup: tuple) -> None:
    model, _, scaler = setup
    model[1].half()
    opt = torch.optim.SGD(model.named_parameters(), lr=0.1)
    model[1].weight.grad = torch.ones_like(model[1].weight)
    before = model[0].weight.grad.clone()
    with pytest.raises(
        LowPrecisionGradError, match=r"FP16 gradients of 2 parameter.*1\.weight, 1\.bias"
    ):
        scaler.unscale_(opt)
    assert torch.equal(before, model[0].weight.grad)  # nothing was unscaled
    assert scaler._phases.get(opt).stage is mixprec.types.OptState.READY


def test_update_after_a_refused_unscale_says_what_happened() -> None:
    """After ``unscale_`` raised for fp16 gradients, ``update()`` says that the optimizer's
    parameters were never checked because a call raised (not "The optimizer has no parameters"
    of an optimizer with two), and how to go on."""
    model = nn.Linear(2, 1).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler()
    scaler.scale(model(torch.ones(1, 2).half()).float().sum()).backward()
    with pytest.raises(LowPrecisionGradError):
        scaler.unscale_(opt)
    with pytest.raises(MissingGradError) as info:
        scaler.update()
    text = str(info.value)
    assert "no parameters" not in text
    assert re.search(r"2 parameter\(s\).*raised before .*checked", text), text
    assert "reset_iteration()" in text


def test_pickle_mid_iteration_is_refused(setup: tuple) -> None:
    _, opt, scaler = setup
    scaler.unscale_(opt)
    with pytest.raises(ScalerStateError, match=r"after update\(\)"):
        pickle.dumps(scaler)
    scaler.step(opt)
    scaler.update()
    assert pickle.loads(pickle.dumps(scaler)).get_scale() == scaler.get_scale()


def test_load_state_dict_validates_first_and_changes_nothing() -> None:
    scaler = mixprec.GradScaler(init_scale=8.0)
    good = scaler.state_dict()
    for bad, fragment in [
        ({}, "empty"),
        ({"scale": 1.0}, "lacks"),
        ({**good, "scale": -1.0}, "must be finite and > 0"),
        ({**good, "scale": float("nan")}, "must be finite and > 0"),
        ({**good, "growth_factor": "2"}, "must be a number"),
        ({**good, "backoff_factor": 1.5}, "backoff_factor"),
        ({**good, "_growth_tracker": 1.5}, "int >= 0"),
        ([1, 2], "expects a dict"),
    ]:
        with pytest.raises(mixprec.errors.ConfigError, match=fragment):
            scaler.load_state_dict(bad)  # type: ignore[arg-type]
        assert scaler.state_dict() == good
