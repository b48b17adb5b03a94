"""Regression tests for the defects found at the edges of the scaler (issue #13, item 4).

Each test names the defect it pins. Where torch has the same behaviour to compare with, the test
runs torch.amp.GradScaler("cpu") beside mixprec, on both of mixprec's paths (tests/conftest.py).
"""

from __future__ import annotations

import math
import pickle
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from tests.scaler_paths import device_path
from torch import nn

import mixprec
from mixprec.errors import ConfigError, MissingGradError, MixprecWarning, ScalerStateError

both_paths = pytest.mark.usefixtures("scaler_path")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _iterate(scaler: Any, model: nn.Module, opt: torch.optim.Optimizer, it: int) -> None:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(it))
    scaler.scale(model(x).pow(2).mean()).backward()
    if it % 3 == 2:
        with torch.no_grad():
            next(model.parameters()).grad.view(-1)[0] = math.inf
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


# ---------------------------------------------------------------- load_state_dict is atomic


@both_paths
@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        (
            {"_overflow_streak": 2**31},
            "state_dict['_overflow_streak'] must be an int <= 2147483647",
        ),
        (
            {"_growth_tracker": 2**35, "growth_interval": 2**40},
            "state_dict['_growth_tracker'] must be an int <= 2147483647",
        ),
        ({"_counters": [2**70, 0, 0, 0]}, "state_dict['_counters'] must be an int <= 2**63"),
        ({"scale": 10**400}, "state_dict['scale'] must be finite and > 0"),
        ({"scale": torch.tensor(2.0 + 1.0j)}, "must be a real number, got a tensor of dtype"),
        ({"scale": torch.ones((), device="meta")}, "must be a real number, got a tensor of dtype"),
        ({"growth_factor": 10**400}, "growth_factor must be finite"),
    ],
    ids=lambda v: str(v)[:30],
)
@pytest.mark.parametrize("when", ["fresh", "trained"])
def test_a_dict_the_state_tensors_cannot_hold_is_refused_and_nothing_changes(
    changes: dict[str, Any], needle: str, when: str
) -> None:
    needle = needle.replace("2**63", str(2**63 - 1))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler(init_scale=2.0**10, growth_interval=2)
    if when == "trained":
        for it in range(4):
            _iterate(scaler, model, opt, it)
    before = scaler.state_dict()
    with pytest.raises(ConfigError) as info:
        scaler.load_state_dict({**before, **changes})
    assert needle in str(info.value)
    assert scaler.state_dict() == before
    _iterate(scaler, model, opt, 5)  # every later scale() still works
    assert scaler.stats().iterations == (5 if when == "trained" else 1)


def test_the_largest_values_the_tensors_hold_load_and_train() -> None:
    scaler = mixprec.GradScaler()
    state = {**scaler.state_dict(), "growth_interval": 2**40, "_growth_tracker": 2**31 - 1}
    state["_counters"] = [2**63 - 2, 0, 0, 0]
    scaler.load_state_dict(state)
    model = _model()
    _iterate(scaler, model, torch.optim.SGD(model.parameters(), lr=0.1), 0)
    assert scaler.stats().iterations == 2**63 - 1


# ---------------------------------------------------------------- no load mid-iteration


def test_a_load_after_scale_and_before_update_is_refused() -> None:
    """The grads of this iteration are scaled with the old scale: loading would mix scales."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler()
    saved = {**scaler.state_dict(), "scale": 1024.0}
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    with pytest.raises(ScalerStateError, match=r"mid-iteration \(scale\(\) was already called"):
        scaler.load_state_dict(saved)
    assert scaler.get_scale() == 2.0**16
    scaler.reset_iteration()
    opt.zero_grad()
    scaler.load_state_dict(saved)
    assert scaler.get_scale() == 1024.0


# ---------------------------------------------------------------- the scale is a float32


def _trajectory(scaler: Any, read: bool, iterations: int = 9) -> list[float]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    for it in range(iterations):
        _iterate(scaler, model, opt, it)
        if read:
            seen.append(scaler.get_scale())
            scaler.state_dict()
            if isinstance(scaler, mixprec.GradScaler):
                scaler.stats()
    return seen if read else [scaler.get_scale()]


ODD = {"growth_factor": 1.7, "backoff_factor": 0.3, "growth_interval": 1}


@both_paths
@pytest.mark.parametrize("init_scale", [1000.1, 3.3e4, 0.1 * 2**20])
def test_non_power_of_two_trajectories_equal_torch(init_scale: float) -> None:
    ours = _trajectory(mixprec.GradScaler(init_scale=init_scale, **ODD), read=True)
    theirs = _trajectory(torch.amp.GradScaler("cpu", init_scale=init_scale, **ODD), read=True)
    assert ours == theirs


@both_paths
@pytest.mark.parametrize("fused", [False, True])
def test_reading_the_scale_never_changes_the_trajectory(fused: bool) -> None:
    def run(read: bool) -> tuple[list[float], dict[str, Any]]:
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
        scaler = mixprec.GradScaler(init_scale=1000.1, **ODD)
        scales = []
        for it in range(9):
            _iterate(scaler, model, opt, it)
            if read:
                scales.append(scaler.get_scale())
        return scales, scaler.state_dict()

    read, quiet = run(read=True), run(read=False)
    assert read[1] == quiet[1]
    assert read[0][-1] == quiet[1]["scale"]


@both_paths
@pytest.mark.parametrize(
    "new_scale", [torch.tensor(1000.1, dtype=torch.float64), 1000.1, torch.tensor(0.1 * 2**14)]
)
def test_a_set_or_loaded_scale_is_rounded_as_torch_rounds_it(new_scale: Any) -> None:
    scalers = {"mixprec": mixprec.GradScaler(**ODD), "torch": torch.amp.GradScaler("cpu", **ODD)}
    scales = {}
    for name, scaler in scalers.items():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        _iterate(scaler, model, opt, 0)
        scaler.scale(torch.ones(()))
        scaler.update(new_scale if isinstance(new_scale, torch.Tensor) else float(new_scale))
        scales[name] = _trajectory(scaler, read=True, iterations=4)
    assert scales["mixprec"] == scales["torch"]
    loaded = mixprec.GradScaler()
    loaded.load_state_dict({**loaded.state_dict(), "scale": 0.1})
    assert loaded.get_scale() == torch.tensor(0.1).item()


def test_init_scale_must_be_a_normal_float32() -> None:
    with pytest.raises(ConfigError, match=r"at least 1\.17549e-38, the smallest normal float32"):
        mixprec.GradScaler(init_scale=1e-40)
    assert mixprec.GradScaler(init_scale=1000.1).get_scale() == torch.tensor(1000.1).item()


# ---------------------------------------------------------------- every bad value: ConfigError


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"init_scale": 10**400}, "init_scale must be finite, got 1000000000"),
        ({"growth_factor": 10**400}, "growth_factor must be finite"),
        ({"history": 10**13}, "history must be an int <= 1000000"),
        ({"growth_interval": 2**64}, "growth_interval must be an int <= "),
        ({"hysteresis": 2**31}, "hysteresis must be an int <= 2147483647"),
    ],
    ids=lambda v: str(v)[:30],
)
def test_huge_settings_are_config_errors(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle[:40].replace("(", r"\(")):
        mixprec.GradScaler(**kwargs)
    scaler = mixprec.GradScaler()
    with pytest.raises(ConfigError):
        scaler.set_growth_factor(10**400)


@pytest.mark.parametrize(
    "new_scale",
    [
        10**400,
        torch.tensor(2.0 + 0.0j),
        torch.tensor(2.0, device="meta"),
        torch.tensor([]),
        torch.tensor(math.nan),
        torch.tensor(0.0),
        torch.tensor(-4.0),
        torch.tensor(1e39, dtype=torch.float64),
    ],
    ids=["huge-int", "complex", "meta", "empty", "nan", "zero", "negative", "above-float32"],
)
@both_paths
def test_bad_new_scales_are_config_errors(new_scale: Any) -> None:
    """Also on the device path: a tensor is checked there too (one read), never copied in blind."""
    scaler = mixprec.GradScaler()
    scaler.scale(torch.ones(()))
    with pytest.raises(ConfigError, match="new_scale"):
        scaler.update(new_scale)
    assert scaler.get_scale() == 2.0**16  # nothing changed


# ---------------------------------------------------------------- scale() and containers


class Fields(dict):  # type: ignore[type-arg]
    """A mapping whose constructor takes keyword fields (like HF's ModelOutput)."""

    def __init__(self, loss: Any = None, aux: Any = None) -> None:
        super().__init__(loss=loss, aux=aux)


class Frozen(Mapping):  # type: ignore[type-arg]
    """A mapping that cannot be rebuilt from its values."""

    def __init__(self) -> None:
        self._data = {"loss": torch.ones(())}

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return 1


def test_scale_rebuilds_the_mappings_it_can_and_refuses_the_rest() -> None:
    scaler = mixprec.GradScaler(init_scale=4.0)
    t = torch.ones(2)
    fields = scaler.scale(Fields(loss=t, aux=t * 2))
    assert type(fields) is Fields and torch.equal(fields["aux"], t * 8)
    counts = defaultdict(list, {"a": t})
    scaled = scaler.scale(counts)
    assert type(scaled) is defaultdict and scaled.default_factory is list
    assert torch.equal(scaled["a"], t * 4)
    assert type(scaler.scale(OrderedDict(a=t))) is OrderedDict
    with pytest.raises(ConfigError, match=r"cannot rebuild a Frozen"):
        scaler.scale(Frozen())


class Pair(list):  # type: ignore[type-arg]
    """A list whose constructor takes its two items, not an iterable."""

    def __init__(self, first: Any, second: Any) -> None:
        super().__init__([first, second])


class Tagged(list):  # type: ignore[type-arg]
    """A list subclass torch and mixprec can rebuild from a list."""


class Counts(defaultdict):  # type: ignore[type-arg]
    """A defaultdict subclass: its factory must survive."""


def test_scale_keeps_sequence_subclasses_it_can_rebuild_and_refuses_the_rest() -> None:
    scaler = mixprec.GradScaler(init_scale=4.0)
    t = torch.ones(2)
    tagged = scaler.scale(Tagged([t, t * 2]))
    assert type(tagged) is Tagged and torch.equal(tagged[1], t * 8)
    counts = scaler.scale(Counts(list, a=t))
    assert type(counts) is Counts and counts.default_factory is list
    assert torch.equal(counts["a"], t * 4)
    with pytest.raises(ConfigError, match=r"cannot rebuild a Pair .*Pair\(list\) does not give"):
        scaler.scale(Pair(t, t))


# ---------------------------------------------------------------- torch's legacy fused contract


class LegacyFusedSGD(torch.optim.SGD):
    """An optimizer written to torch's legacy contract: it unscales and checks itself."""

    _step_supports_amp_scaling = True

    def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:  # type: ignore[override]
        if grad_scaler is None:
            return super().step(closure)
        found = grad_scaler._check_inf_per_device(self)
        if sum(v.item() for v in found.values()):
            return None
        inv = grad_scaler._get_scale_async().double().reciprocal().float()
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv)
        return super().step(closure)


class LegacyThatForgets(LegacyFusedSGD):
    def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:  # type: ignore[override]
        return None


@both_paths
def test_legacy_fused_optimizers_train_as_with_torch() -> None:
    runs = []
    for scaler in (
        mixprec.GradScaler(growth_interval=2),
        torch.amp.GradScaler("cpu", growth_interval=2),
    ):
        model = _model()
        opt = LegacyFusedSGD(model.parameters(), lr=0.1)
        with pytest.warns(FutureWarning, match="stop passing itself"):
            scales = _trajectory_with(scaler, model, opt)
        runs.append((scales, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


def _trajectory_with(scaler: Any, model: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    scales = []
    for it in range(6):
        _iterate(scaler, model, opt, it)
        scales.append(scaler.get_scale())
        if isinstance(scaler, mixprec.GradScaler):  # the optimizer's own check is recorded
            assert scaler.last_step_skipped(opt) == (it % 3 == 2), it
    return scales


# ---------------------------------------------------------------- messages are true


def test_an_optimizer_that_checks_nothing_is_not_said_to_have_no_parameters() -> None:
    model = _model()
    opt = LegacyThatForgets(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scaler.step(opt)
    with pytest.raises(MissingGradError) as info:
        scaler.update()
    assert "no parameters" not in str(info.value)
    assert "Its 4 parameter(s) were never checked" in str(info.value)
    assert "_check_inf_per_device" in str(info.value)


def test_a_failed_step_is_not_reported_as_an_unscale() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler()
    scaler.scale(model(torch.ones(2, 4)).sum())  # no backward: nothing to step
    with pytest.raises(MissingGradError, match="None of the optimizer's 4 parameter"):
        scaler.step(opt)
    with pytest.raises(ScalerStateError) as info:
        pickle.dumps(scaler)
    assert "already unscaled" not in str(info.value)
    assert "passed to step() or unscale_(), which raised" in str(info.value)


# ---------------------------------------------------------------- fused: no read after the first


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    for name in ("item", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: Any, _o: Any = original, _n: str = name) -> Any:
            reads.append(_n)
            return _o(self, *a)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, fused=True),  # its state stays empty
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
        lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    ],
    ids=["sgd", "sgd-momentum", "adamw"],
)
def test_a_fused_iteration_reads_nothing_after_the_first(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with device_path():  # the CUDA user's path, where a read is a sync
        model = _model()
        opt = make(model.parameters())
        scaler = mixprec.GradScaler()
        reads = _count_reads(monkeypatch)
        per_iteration = []
        for _ in range(4):
            before = len(reads)
            scaler.scale(model(torch.ones(2, 4)).pow(2).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            per_iteration.append(len(reads) - before)
        monkeypatch.undo()
    assert per_iteration == [1, 0, 0, 0]


# ---------------------------------------------------------------- closures


def test_a_closure_that_never_scales_is_refused_on_every_iteration() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler()

    def good() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).sum()
        scaler.scale(loss).backward()
        return loss

    def bad() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        return loss

    scaler.step(opt, good)
    scaler.update()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ScalerStateError, match=r"did not call scaler\.scale\(\)"):
        scaler.step(opt, bad)  # the second iteration: the scale exists already
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(
    ("kwargs", "saved", "loaded"),
    [({}, 1e-45, 2.0**-126), ({"init_scale": 2.0**8, "max_scale": 2.0**10}, 2.0**16, 2.0**10)],
    ids=["subnormal", "above-max_scale"],
)
def test_a_loaded_scale_outside_the_bounds_is_clamped_with_a_warning(
    kwargs: dict[str, Any], saved: float, loaded: float
) -> None:
    state = torch.amp.GradScaler("cpu").state_dict()  # torch's keys: the scaler's bounds stay
    state["scale"] = saved
    scaler = mixprec.GradScaler(**kwargs)
    with pytest.warns(
        MixprecWarning, match=r"state_dict\['scale'\] = .* outside this scaler's bounds"
    ):
        scaler.load_state_dict(state)
    assert scaler.get_scale() == loaded
