"""Bad input: every case raises a clear error (naming the value and the fix) and changes nothing.

"Nothing" is checked on a scaler caught mid-iteration (scaled, backward done, one optimizer
unscaled): its state dict, the phase of each optimizer and the gradients are compared before and
after the failing call, and the iteration is then finished normally.
"""

from __future__ import annotations

import math
from collections import OrderedDict, namedtuple
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from mixprec._src.scaling.phases import OptState
from mixprec.errors import ConfigError, LowPrecisionGradError


class Rig:
    """A scaler mid-iteration: scaled, backward done, ``opts[0]`` unscaled, ``opts[1]`` READY."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.modules = [nn.Linear(3, 2), nn.Linear(3, 2)]
        self.opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in self.modules]
        self.scaler = mixprec.GradScaler(init_scale=2.0**8, growth_interval=1)
        loss = sum(m(torch.randn(4, 3)).sum() for m in self.modules)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opts[0])

    def snapshot(self) -> tuple[Any, ...]:
        phases = []
        for opt in self.opts:
            record = self.scaler._phases.peek(opt)
            # A record created READY by a call that then failed is the same phase as none.
            phases.append(OptState.READY if record is None else record.stage)
        grads = [p.grad.clone() for m in self.modules for p in m.parameters()]
        return self.scaler.state_dict(), phases, grads

    def assert_unchanged(self, before: tuple[Any, ...]) -> None:
        sd, phases, grads = self.snapshot()
        assert sd == before[0]
        assert phases == before[1] == [OptState.UNSCALED, OptState.READY]
        for a, b in zip(grads, before[2], strict=True):
            assert torch.equal(a, b)

    def finish(self) -> None:
        """The iteration still completes after the error."""
        scale = self.scaler.get_scale()
        for opt in self.opts:
            self.scaler.step(opt)
        self.scaler.update()
        assert self.scaler.get_scale() == 2 * scale  # clean iteration, growth_interval=1


def check(call: Callable[[Rig], Any], error: type[Exception], *needles: str) -> str:
    rig = Rig()
    before = rig.snapshot()
    with pytest.raises(error) as info:
        call(rig)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    rig.assert_unchanged(before)
    rig.finish()
    return message


# ---------------------------------------------------------------------------- scale


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (3, "int (3)"),
        (2.5, "float (2.5)"),
        ("loss", "str ('loss')"),
        (None, "NoneType (None)"),
        (b"x", "bytes"),
        (object(), "object"),
    ],
)
def test_scale_rejects_non_tensors(value: Any, needle: str) -> None:
    message = check(lambda rig: rig.scaler.scale(value), ConfigError, needle, "scaler.scale(loss)")
    assert message.startswith("outputs must be a Tensor")


@pytest.mark.parametrize("value", [[torch.ones(()), 3], {"a": torch.ones(()), "b": "x"}])
def test_scale_rejects_a_non_tensor_leaf(value: Any) -> None:
    check(lambda rig: rig.scaler.scale(value), ConfigError, "outputs must be a Tensor")


def test_scale_of_a_non_tensor_leaves_a_fresh_scaler_uninitialised() -> None:
    scaler = mixprec.GradScaler()
    with pytest.raises(ConfigError):
        scaler.scale(None)
    assert scaler._get_scale_async() is None


Pair = namedtuple("Pair", "a b")


def test_scale_maps_nested_containers_and_keeps_their_types() -> None:
    scaler = mixprec.GradScaler(init_scale=4.0)
    t = torch.ones(2)
    out = scaler.scale(
        {"d": OrderedDict(x=t), "l": [t, (t, t)], "n": Pair(t, [t]), "g": (u for u in [t])}
    )
    assert type(out) is dict and type(out["d"]) is OrderedDict
    assert type(out["l"]) is list and type(out["l"][1]) is tuple
    assert type(out["n"]) is Pair and type(out["n"].b) is list
    assert type(out["g"]) is list  # other iterables come back as lists
    leaves = [out["d"]["x"], *out["l"][:1], *out["l"][1], out["n"].a, *out["n"].b, *out["g"]]
    assert all(torch.equal(v, t * 4) for v in leaves)


def test_scale_of_a_dict_of_losses_trains() -> None:
    rig = Rig()
    rig.scaler.update()  # end the rig's iteration
    scale = rig.scaler.get_scale()
    losses = {k: m(torch.randn(4, 3)).sum() for k, m in zip("ab", rig.modules, strict=True)}
    scaled = rig.scaler.scale(losses)
    assert type(scaled) is dict and list(scaled) == ["a", "b"]
    assert all(torch.equal(scaled[k], losses[k] * scale) for k in losses)  # (a power of two)
    (scaled["a"] + scaled["b"]).backward()
    rig.finish()


# ---------------------------------------------------------------------------- update(new_scale)


@pytest.mark.parametrize(
    ("value", "needles"),
    [
        (0.0, ("got 0.0", "within [")),
        (0, ("got 0", "within [")),
        (-1.0, ("got -1.0", "within [")),
        (math.inf, ("got inf", "within [")),
        (math.nan, ("got nan", "within [")),
        (1e39, ("got 1e+39", "within [")),
        (torch.tensor(0.0), ("got 0.0", "within [")),
        (torch.tensor(math.nan), ("got nan", "within [")),
        (torch.ones(2), ("shape (2,)", "1-element tensor")),
        (torch.tensor(2.0, requires_grad=True), ("requires_grad=True", "requires_grad=False")),
        (torch.tensor(2.0, device="meta"), ("is on meta", "new_scale.to('cpu')")),
        ("2", ("got str", "a float")),
        (True, ("got bool", "a float")),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_update_rejects_bad_new_scale(value: Any, needles: tuple[str, ...]) -> None:
    check(lambda rig: rig.scaler.update(new_scale=value), ConfigError, "new_scale", *needles)


def test_update_with_an_optimizer_that_did_nothing_this_iteration() -> None:
    from mixprec.errors import ScalerStateError

    check(lambda rig: rig.scaler.update(rig.opts[1]), ScalerStateError, "scaler.step(optimizer)")


# ---------------------------------------------------------------------------- setters


@pytest.mark.parametrize(
    ("setter", "value", "needle"),
    [
        ("set_growth_factor", 1.0, "growth_factor must be > 1.0, got 1.0"),
        ("set_growth_factor", 0.5, "growth_factor must be > 1.0, got 0.5"),
        ("set_growth_factor", math.nan, "growth_factor must be finite, got nan"),
        ("set_growth_factor", "2", "growth_factor must be a real number, got '2'"),
        ("set_backoff_factor", 1.0, "backoff_factor must be in the open range (0, 1), got 1.0"),
        ("set_backoff_factor", 0.0, "backoff_factor must be in the open range (0, 1), got 0.0"),
        ("set_backoff_factor", -0.5, "(0, 1), got -0.5"),
        ("set_backoff_factor", math.inf, "backoff_factor must be finite, got inf"),
        ("set_growth_interval", 0, "growth_interval must be an int >= 1, got 0"),
        ("set_growth_interval", -3, "growth_interval must be an int >= 1, got -3"),
        ("set_growth_interval", 2.0, "growth_interval must be an int >= 1, got 2.0 (float)"),
        ("set_growth_interval", True, "growth_interval must be an int >= 1, got True (bool)"),
    ],
)
def test_setters_reject_out_of_range(setter: str, value: Any, needle: str) -> None:
    def call(rig: Rig) -> None:
        config = rig.scaler.config
        try:
            getattr(rig.scaler, setter)(value)
        finally:
            assert rig.scaler.config == config

    check(call, ConfigError, needle)


# ---------------------------------------------------------------------------- constructor


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"init_scale": 0.0}, "init_scale must be in (0, "),
        ({"init_scale": -1.0}, "got -1.0"),
        ({"init_scale": math.inf}, "init_scale must be finite, got inf"),
        ({"init_scale": math.nan}, "init_scale must be finite, got nan"),
        ({"init_scale": "big"}, "init_scale must be a real number, got 'big'"),
        ({"growth_factor": 1.0}, "growth_factor must be > 1.0"),
        ({"backoff_factor": 1.0}, "backoff_factor must be in the open range (0, 1)"),
        ({"backoff_factor": 0}, "backoff_factor must be in the open range (0, 1), got 0.0"),
        ({"growth_interval": 0}, "growth_interval must be an int >= 1, got 0"),
        ({"growth_interval": 2.0}, "growth_interval must be an int >= 1, got 2.0 (float)"),
        ({"enabled": "yes"}, "enabled must be a bool, got 'yes'"),
        ({"device": 3}, "device must be a str, a torch.device or None, got 3"),
        ({"device": "gpu0"}, "device 'gpu0' is not a torch device"),
        ({"min_scale": 0.0}, "min_scale must be >= "),
        ({"min_scale": 8.0, "max_scale": 4.0}, "min_scale (8.0) must not exceed max_scale (4.0)"),
        ({"max_scale": 1024.0}, "init_scale (65536.0) must lie within [min_scale, max_scale]"),
        ({"hysteresis": 0}, "hysteresis must be an int >= 1, got 0"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips must be an int >= 1, got 0"),
        ({"history": -1}, "history must be an int >= 0 (entries kept), got -1"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_constructor_rejects_bad_values(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        mixprec.GradScaler(**kwargs)
    assert needle in str(info.value)


# ---------------------------------------------------------------------------- load_state_dict


def _good_state() -> dict[str, Any]:
    return mixprec.GradScaler(init_scale=32.0, growth_interval=7).state_dict()


def _without(key: str) -> dict[str, Any]:
    sd = _good_state()
    del sd[key]
    return sd


def _with(**changes: Any) -> dict[str, Any]:
    return {**_good_state(), **changes}


@pytest.mark.parametrize(
    ("state", "needles"),
    [
        ({}, ("empty", "disabled", "enabled=False")),
        (mixprec.GradScaler(enabled=False).state_dict(), ("empty", "disabled")),
        ([("scale", 1.0)], ("expects a dict", "got list")),
        (None, ("expects a dict", "got NoneType")),
        *[
            (_without(k), (f"lacks [{k!r}]", "GradScaler.state_dict()"))
            for k in (
                "scale",
                "growth_factor",
                "backoff_factor",
                "growth_interval",
                "_growth_tracker",
            )
        ],
        (_with(scale=-1.0), ("state_dict['scale'] must be finite and > 0, got -1.0",)),
        (_with(scale=0.0), ("state_dict['scale'] must be finite and > 0, got 0.0",)),
        (_with(scale=math.nan), ("state_dict['scale'] must be finite and > 0, got nan",)),
        (_with(scale=math.inf), ("state_dict['scale'] must be finite and > 0, got inf",)),
        (_with(scale="1024"), ("state_dict['scale'] must be a number, got '1024' (str)",)),
        (_with(scale=torch.ones(2)), ("state_dict['scale'] must hold one number",)),
        (_with(growth_interval=2.5), ("state_dict['growth_interval'] must be an int, got 2.5",)),
        (_with(growth_interval=None), ("state_dict['growth_interval'] must be a number",)),
        (_with(growth_factor=0.5), ("growth_factor must be > 1.0, got 0.5",)),
        (_with(backoff_factor=2.0), ("backoff_factor must be in the open range (0, 1)",)),
        (_with(_growth_tracker=-1), ("state_dict['_growth_tracker'] must be an int >= 0, got -1",)),
        (_with(_growth_tracker=True), ("state_dict['_growth_tracker'] must be a number",)),
        (_with(_counters=[1, 2]), ("state_dict['_counters'] must be a list of 4 ints",)),
    ],
    ids=lambda v: str(v)[:50],
)
def test_load_state_dict_rejects_bad_dicts(state: Any, needles: tuple[str, ...]) -> None:
    check(lambda rig: rig.scaler.load_state_dict(state), ConfigError, *needles)


def test_load_state_dict_accepts_torch_tensors_and_ignores_unknown_keys() -> None:
    reference = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        reference.scale(model(torch.randn(2, 3)).sum()).backward()
        reference.step(opt)
        reference.update()
        opt.zero_grad()
    torch_state = reference.state_dict()
    scaler = mixprec.GradScaler()
    scaler.load_state_dict({**torch_state, "from_another_tool": {"x": 1}})
    assert scaler.get_scale() == reference.get_scale() == 2.0**11
    assert scaler._get_growth_tracker() == reference._get_growth_tracker() == 1
    assert scaler.get_growth_interval() == 3
    as_tensors = {k: torch.tensor(v) for k, v in torch_state.items()}
    scaler.load_state_dict(as_tensors)
    assert scaler.state_dict()["scale"] == 2.0**11


def test_disabled_scaler_ignores_any_state_dict() -> None:
    scaler = mixprec.GradScaler(enabled=False)
    scaler.load_state_dict({})
    scaler.load_state_dict(_good_state())
    assert scaler.state_dict() == {}


# ---------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize("call", ["unscale_", "step"])
@pytest.mark.parametrize("junk", [3, "weight", None])
def test_param_groups_holding_non_tensors(call: str, junk: Any) -> None:
    def run(rig: Rig) -> None:
        rig.opts[1].param_groups[0]["params"].append(junk)
        try:
            getattr(rig.scaler, call)(rig.opts[1])
        finally:
            rig.opts[1].param_groups[0]["params"].pop()

    name = type(junk).__name__
    check(run, ConfigError, f"param_groups[0]['params'][2] is a {name}", "model.parameters()")


def test_fp16_grads_are_named_and_left_untouched() -> None:
    def run(rig: Rig) -> None:
        half = nn.Parameter(torch.zeros(2, dtype=torch.float16))
        half.grad = torch.full((2,), 3.0, dtype=torch.float16)
        rig.opts[1].add_param_group({"params": [half]})
        try:
            rig.scaler.unscale_(rig.opts[1])
        finally:
            rig.opts[1].param_groups.pop()
        assert torch.equal(half.grad, torch.full((2,), 3.0, dtype=torch.float16))

    check(run, LowPrecisionGradError, "param_groups[1]['params'][0]")


@pytest.mark.parametrize("call", ["unscale_", "step"])
@pytest.mark.parametrize("what", ["model", "None", "str"])
def test_a_non_optimizer_is_refused_before_any_record_exists(call: str, what: str) -> None:
    def run(rig: Rig) -> None:
        records = len(rig.scaler._phases)
        bad = {"model": rig.modules[1], "None": None, "str": "opt"}[what]
        try:
            getattr(rig.scaler, call)(bad)
        finally:
            assert len(rig.scaler._phases) == records  # no phantom record (pickle would refuse)

    name = {"model": "Linear", "None": "NoneType", "str": "str"}[what]
    needles = [f"{call}() expects a torch.optim.Optimizer", f"got {name}."]
    if what == "model":
        needles.append("Pass the optimizer, not the model.")
    check(run, ConfigError, *needles)


def test_a_meta_loss_cannot_become_the_home_of_the_scale() -> None:
    scaler = mixprec.GradScaler()
    with pytest.raises(ConfigError, match=r"'meta' device.*to_empty"):
        scaler.scale(torch.ones((), device="meta"))
    assert scaler._get_scale_async() is None  # still usable: the next real loss creates it
    assert scaler.scale(torch.ones(())).item() == 2.0**16
    assert scaler.scale(torch.ones((), device="meta")).device.type == "meta"  # a copy, later
