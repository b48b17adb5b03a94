"""find_nonfinite: the first inf/NaN, injected mid-network, is blamed on the right module."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mixprec
from mixprec.errors import NonFiniteError, OverflowRiskWarning


class GradBomb(torch.autograd.Function):
    """Identity forward; its backward returns inf (a broken custom backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


class Bomb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return GradBomb.apply(x) if self.armed else x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.bomb = Bomb()
        self.blow_up = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        if self.blow_up:
            x = x * 1e30  # a functional op between submodules
        return self.bomb(self.act(x))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = nn.Sequential(Block(), Block(), Block())
    return nn.Sequential(OrderedDict(stem=nn.Linear(8, 8), blocks=blocks, head=nn.Linear(8, 1)))


X = torch.randn(16, 8)


def _run(model: nn.Module, loss_factor: float = 1.0, **kw: Any) -> mixprec.types.NonFiniteFinder:
    with mixprec.find_nonfinite(model, **kw) as finder:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(X)
        (out.float().pow(2).mean() * loss_factor).backward()
    return finder


def test_a_healthy_run_reports_nothing_and_changes_nothing() -> None:
    model = _model()
    with torch.autocast("cpu", dtype=torch.float16):
        expected = model(X)
    finder = _run(model)
    assert finder.report is None and not finder.found
    with mixprec.find_nonfinite(model), torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(model(X), expected)


def test_forward_overflow_in_a_mid_network_layer_is_blamed_on_that_layer() -> None:
    model = _model()
    with torch.no_grad():
        model.blocks[1].fc.weight[0].mul_(1e6)  # one fp16 output feature overflows there
    report = _run(model).report
    assert report is not None
    assert (report.module, report.phase, report.what) == ("blocks.1.fc", "forward", "output")
    assert report.dtype == torch.float16
    assert 0 < report.max_finite < 100  # the other features stayed small
    assert "'blocks.1.fc'" in str(report)


def test_a_functional_op_between_submodules_is_blamed_on_the_parent() -> None:
    model = _model()
    model.blocks[2].blow_up = True
    report = _run(model).report
    assert report is not None
    assert (report.module, report.phase, report.what) == ("blocks.2", "forward", "input")
    assert "'blocks.2.act'" in report.detail


def test_backward_inf_produced_mid_network_is_blamed_on_the_module_that_produced_it() -> None:
    model = _model()
    model.blocks[1].bomb.armed = True
    report = _run(model).report
    assert report is not None
    assert (report.module, report.phase, report.what) == (
        "blocks.1.bomb",
        "backward",
        "input gradient",
    )


def test_gradient_overflowing_at_the_output_is_blamed_on_the_loss_side() -> None:
    report = _run(_model(), loss_factor=1e9).report  # the fp16 output's gradient overflows
    assert report is not None
    assert (report.module, report.phase, report.what) == ("head", "backward", "output gradient")
    assert report.dtype == torch.float16


def test_parameter_gradient_overflow_names_the_parameter() -> None:
    model = _model()
    model.head.weight.register_hook(lambda g: g * float("inf"))  # registered before entering
    report = _run(model).report
    assert report is not None
    assert (report.module, report.phase) == ("head", "backward")
    assert report.what == "gradient of parameter 'weight'"


def test_non_finite_model_input_is_reported_as_such() -> None:
    model = _model()
    with mixprec.find_nonfinite(model) as finder:
        model(torch.full((2, 8), float("nan")))
    assert finder.report is not None
    assert (finder.report.module, finder.report.what) == ("", "input")


def test_near_overflow_warning_names_the_module() -> None:
    model = _model()
    with torch.no_grad():
        model.head.weight.fill_(1.0)
        model.head.bias.fill_(3e4)
    with pytest.warns(OverflowRiskWarning, match="'head'"):
        finder = _run(model, warn_within=4.0)
    assert finder.report is None
    assert finder.near_overflow["head"] > 65504 / 4


def test_raise_on_first_raises_from_the_forward() -> None:
    model = _model()
    with torch.no_grad():
        model.blocks[0].fc.weight.mul_(1e6)
    with pytest.raises(NonFiniteError, match=r"blocks\.0\.fc") as info:
        _run(model, raise_on_first=True)
    assert isinstance(info.value, FloatingPointError)


def test_no_hook_remains_after_the_block() -> None:
    model = _model()
    with mixprec.find_nonfinite(model):
        pass
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    for param in model.parameters():
        assert not param._backward_hooks
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(X)
    F.mse_loss(out.float(), torch.zeros(16, 1)).backward()  # no hook runs, nothing breaks


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(mixprec.errors.ConfigError, match=r"nn\.Module"):
        mixprec.find_nonfinite(object())  # type: ignore[arg-type]
    with pytest.raises(mixprec.errors.ConfigError, match="warn_within"):
        mixprec.find_nonfinite(_model(), warn_within=0.5)


def test_empty_outputs_are_ignored() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with mixprec.find_nonfinite(model) as finder:
        model(torch.randn(0, 4))  # an empty batch
    assert finder.report is None


class KeywordModel(nn.Module):
    """Called with keyword arguments only (as transformers models are)."""

    def __init__(self) -> None:
        super().__init__()
        self.skip = nn.Identity()
        self.bomb = Bomb()
        self.fc = nn.Linear(8, 1)

    def forward(self, *, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bomb(self.skip(hidden)))


def test_keyword_inputs_and_pass_through_modules() -> None:
    model = KeywordModel()
    with mixprec.find_nonfinite(model) as finder:
        model(hidden=torch.full((2, 8), float("inf")))
    assert finder.report is not None and finder.report.what == "input"
    model.bomb.armed = True
    hidden = torch.randn(2, 8, requires_grad=True)
    with mixprec.find_nonfinite(model) as finder:
        model(hidden=hidden).sum().backward()
    assert finder.report is not None
    # nn.Identity hands its input back: the gradient it "produces" is not its doing
    assert (finder.report.module, finder.report.what) == ("bomb", "input gradient")


class ScalesItsChild(nn.Module):
    """Changes its child's output before returning it, in place or not."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.in_place:
            return y.mul_(float("inf"))
        return y * float("inf")


@pytest.mark.parametrize("in_place", [False, True])
def test_a_forward_that_changes_its_childs_output_is_blamed_in_place_or_not(
    in_place: bool,
) -> None:
    model = nn.Sequential(ScalesItsChild(in_place), nn.Linear(8, 1))
    with mixprec.find_nonfinite(model) as finder:
        model(X)
    assert finder.report is not None
    assert (finder.report.module, finder.report.phase, finder.report.what) == (
        "0",
        "forward",
        "output",
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warn_within": "x"}, "warn_within must be None or a number >= 1"),
        ({"warn_within": True}, "got bool True"),
        ({"warn_within": float("nan")}, "warn_within"),
        ({"raise_on_first": "yes"}, "raise_on_first must be True or False"),
    ],
)
def test_bad_options_are_config_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(mixprec.errors.ConfigError, match=match):
        mixprec.find_nonfinite(_model(), **kwargs)


def test_the_near_overflow_warning_points_at_the_line_that_called_the_model() -> None:
    model = _model()
    with torch.no_grad():
        model.head.weight.fill_(1.0)
        model.head.bias.fill_(3e4)
    with pytest.warns(OverflowRiskWarning) as caught:
        _run(model, warn_within=4.0)
    assert {w.filename for w in caught} == {__file__}
