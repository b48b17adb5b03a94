"""GradScaler's API: call forms, nesting, enabled=False, fused protocol, sparse and mixed grads."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch import nn

import mixprec
from mixprec.errors import ConfigError

# Every test runs on the CPU's path and on the path a CUDA user takes (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("scaler_path")


def _model_and_opt(**opt_kwargs: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, **opt_kwargs)  # type: ignore[arg-type]


def _backward(scaler: mixprec.GradScaler, model: nn.Module) -> None:
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((1024.0, 3.0, 0.25, 7, True), {}),  # the seed's positional form
        (("cpu", 1024.0, 3.0, 0.25, 7, True), {}),  # torch 2's positional form
        (
            (),
            {
                "device": "cuda",
                "init_scale": 1024.0,
                "growth_factor": 3.0,
                "backoff_factor": 0.25,
                "growth_interval": 7,
            },
        ),
        ((1024.0,), {"growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 7}),
    ],
)
def test_constructor_forms(args: tuple, kwargs: dict) -> None:
    scaler = mixprec.GradScaler(*args, **kwargs)
    assert scaler.get_scale() == 1024.0
    assert scaler.get_growth_factor() == 3.0
    assert scaler.get_backoff_factor() == 0.25
    assert scaler.get_growth_interval() == 7
    assert scaler.is_enabled()


def test_cuda_scaler_without_cuda_scales_for_real() -> None:
    assert not torch.cuda.is_available()
    scaler = mixprec.GradScaler("cuda")
    assert scaler.is_enabled()
    out = scaler.scale(torch.tensor(2.0))
    assert out.item() == 2.0 * 65536 and out.device.type == "cpu"


def test_repeated_argument_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        mixprec.GradScaler(1024.0, init_scale=2.0)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"growth_factor": 1.0}, "growth_factor must be > 1.0"),
        ({"backoff_factor": 1.0}, "backoff_factor must be in the open range (0, 1)"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval must be an int >= 1"),
        ({"growth_interval": 2.0}, "growth_interval must be an int"),
        ({"init_scale": 0.0}, "init_scale must be in"),
        ({"init_scale": math.inf}, "init_scale must be finite"),
        ({"init_scale": "big"}, "init_scale must be a real number"),
        ({"enabled": "yes"}, "enabled must be a bool"),
        ({"device": "nonsense"}, "is not a torch device"),
        ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, "must not exceed"),
        ({"hysteresis": 0}, "hysteresis must be an int >= 1"),
        ({"history": -1}, "history must be an int >= 0"),
    ],
)
def test_bad_settings_raise_config_error(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        mixprec.GradScaler(**kwargs)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_setters_validate_and_keep_old_value() -> None:
    scaler = mixprec.GradScaler()
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(10)
    for setter, bad in [
        (scaler.set_growth_factor, 0.5),
        (scaler.set_backoff_factor, 2.0),
        (scaler.set_growth_interval, -3),
    ]:
        with pytest.raises(ConfigError):
            setter(bad)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (4.0, 0.25)
    assert scaler.get_growth_interval() == 10


# ---------------------------------------------------------------- scale()

Pair = collections.namedtuple("Pair", "a b")


def test_scale_nested_structures_keep_their_types() -> None:
    scaler = mixprec.GradScaler(init_scale=2.0)
    t = torch.ones(2)
    out = scaler.scale([t, (t, Pair(t, t)), {"x": t}])
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], Pair)
    assert isinstance(out[2], dict)
    assert torch.equal(out[1][1].b, t * 2) and torch.equal(out[2]["x"], t * 2)
    generated = scaler.scale(x for x in [t, t])
    assert [g.tolist() for g in generated] == [[2.0, 2.0], [2.0, 2.0]]


def test_scale_matches_torch_promotion() -> None:
    ours, theirs = mixprec.GradScaler(), torch.amp.GradScaler("cpu")
    for value in [
        torch.tensor(1.5, dtype=torch.float16),
        torch.ones(3, dtype=torch.float16),
        torch.tensor(3),
        torch.ones(2, dtype=torch.float64),
    ]:
        a, b = ours.scale(value), theirs.scale(value)
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_scale_on_several_devices_uses_first_device() -> None:
    scaler = mixprec.GradScaler(init_scale=4.0)
    out = scaler.scale([torch.ones(1), torch.ones(1, device="meta")])
    assert scaler._get_scale_async().device.type == "cpu"  # type: ignore[union-attr]
    assert out[1].device.type == "meta" and out[0].item() == 4.0


@pytest.mark.parametrize("bad", [3.0, 3, None, "loss", [torch.ones(1), 3]])
def test_scale_rejects_non_tensors(bad: object) -> None:
    scaler = mixprec.GradScaler()
    with pytest.raises(ConfigError, match="must be a Tensor or an iterable of Tensors"):
        scaler.scale(bad)


# ---------------------------------------------------------------- enabled=False


def test_disabled_scaler_is_a_pass_through() -> None:
    model, opt = _model_and_opt()
    scaler = mixprec.GradScaler(enabled=False)
    loss = model(torch.ones(3, 4)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    before = model.weight.detach().clone()
    scaler.unscale_(opt)
    assert scaler.step(opt) is None
    assert not torch.equal(before, model.weight)
    scaler.update()
    scaler.load_state_dict({"anything": 1})
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    assert scaler.get_growth_factor() == 2.0  # getters still answer (torch raises)
    assert not scaler.last_step_skipped()


# ---------------------------------------------------------------- update()


def test_update_new_scale_forms_keep_growth_tracker() -> None:
    model, opt = _model_and_opt()
    scaler = mixprec.GradScaler(growth_interval=100)
    for _ in range(3):
        _backward(scaler, model)
        scaler.step(opt)
        scaler.update()
    for new_scale in (512.0, 256, torch.tensor([128.0]), torch.tensor(64.0, dtype=torch.float64)):
        _backward(scaler, model)
        scaler.step(opt)
        scaler.update(new_scale)
        assert scaler.get_scale() == float(new_scale)
    assert scaler._get_growth_tracker() == 3


def test_update_with_optimizer_is_update() -> None:
    model, opt = _model_and_opt()
    ours, theirs = (
        mixprec.GradScaler(growth_interval=1),
        torch.amp.GradScaler("cpu", growth_interval=1),
    )
    for _ in range(3):
        _backward(ours, model)
        ours.step(opt)
        ours.update(opt)
        theirs.scale(torch.ones(()))
        theirs.update(theirs.get_scale() * 2)
    assert ours.get_scale() == theirs.get_scale() == 65536.0 * 8


def test_update_with_unstepped_optimizer_raises() -> None:
    model, opt = _model_and_opt()
    _, other = _model_and_opt()
    scaler = mixprec.GradScaler()
    _backward(scaler, model)
    scaler.step(opt)
    with pytest.raises(mixprec.errors.ScalerStateError, match="neither unscaled nor stepped"):
        scaler.update(other)
    scaler.update(opt)


# ---------------------------------------------------------------- fused optimizers


def test_fused_sgd_momentum_skipped_first_step_leaves_optimizer_untouched() -> None:
    """torch's fused SGD keeps an uninitialised momentum buffer after a skipped first step."""

    def run(scaler: object) -> torch.Tensor:
        model, _ = _model_and_opt()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        for it in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.ones(3, 4)).sum()).backward()  # type: ignore[attr-defined]
            if it == 0:
                model.weight.grad[0, 0] = math.inf
            scaler.step(opt)  # type: ignore[attr-defined]
            scaler.update(65536.0)  # type: ignore[attr-defined]
        return model.weight.detach().clone()

    def reference() -> torch.Tensor:  # fp32 SGD with momentum, the first step simply absent
        model, _ = _model_and_opt()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
        return model.weight.detach().clone()

    assert torch.allclose(run(mixprec.GradScaler()), reference(), rtol=0, atol=1e-6)


def test_fused_skip_is_visible_and_attributes_are_removed() -> None:
    model, _ = _model_and_opt()
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    scaler = mixprec.GradScaler()
    for it in range(3):
        opt.zero_grad()
        _backward(scaler, model)
        if it == 2:
            model.bias.grad[0] = math.nan
        before = model.bias.detach().clone()
        scaler.step(opt)
        assert scaler.last_step_skipped(opt) == (it == 2)
        assert torch.equal(before, model.bias) == (it == 2)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        scaler.update()


def test_fused_optimizer_respects_user_grad_scale() -> None:
    seen = {}

    class Spy(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None):  # type: ignore[no-untyped-def,override]
            seen["grad_scale"] = self.grad_scale.item()  # type: ignore[attr-defined]
            seen["found_inf"] = self.found_inf.shape  # type: ignore[attr-defined]

    model, _ = _model_and_opt()
    opt = Spy(model.parameters(), lr=0.1)
    opt.state[model.weight] = {"x": 1}
    opt.state[model.bias] = {"x": 1}
    opt.grad_scale = torch.tensor(0.5)  # type: ignore[attr-defined]
    scaler = mixprec.GradScaler(init_scale=8.0)
    _backward(scaler, model)
    scaler.step(opt)
    assert seen == {"grad_scale": 4.0, "found_inf": torch.Size([])}


def test_legacy_fused_contract_gets_the_scaler() -> None:
    got = {}

    class Legacy(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, *, grad_scaler=None):  # type: ignore[no-untyped-def,override]
            got["scaler"] = grad_scaler

    model, _ = _model_and_opt()
    scaler = mixprec.GradScaler()
    _backward(scaler, model)
    with pytest.warns(FutureWarning, match="stop passing itself"):
        scaler.step(Legacy(model.parameters(), lr=0.1))
    assert got["scaler"] is scaler


# ---------------------------------------------------------------- grads of many kinds


def test_sparse_grads_match_torch() -> None:
    def run(scaler: object) -> tuple[torch.Tensor, list[float]]:
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        scales = []
        for it in range(4):
            opt.zero_grad()
            loss = emb(torch.tensor([1, 2, 2, 5])).sum()
            scaler.scale(loss).backward()  # type: ignore[attr-defined]
            if it == 1:
                emb.weight.grad._values()[0, 0] = math.inf
            scaler.step(opt)  # type: ignore[attr-defined]
            scaler.update()  # type: ignore[attr-defined]
            scales.append(scaler.get_scale())  # type: ignore[attr-defined]
        return emb.weight.detach(), scales

    ours, theirs = (
        run(mixprec.GradScaler(growth_interval=1)),
        run(torch.amp.GradScaler("cpu", growth_interval=1)),
    )
    assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1]
    assert ours[1][1] < ours[1][0]


def test_mixed_fp32_fp64_grads_are_each_unscaled() -> None:
    a = nn.Parameter(torch.ones(3))
    b = nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = torch.optim.SGD([a, b], lr=1.0)
    scaler = mixprec.GradScaler(init_scale=8.0)
    scaler.scale([a.sum(), b.sum()])  # scale lives on the CPU
    a.grad, b.grad = torch.full((3,), 8.0), torch.full((3,), 16.0, dtype=torch.float64)
    scaler.unscale_(opt)
    assert a.grad.tolist() == [1.0] * 3 and b.grad.tolist() == [2.0] * 3
    b.grad[1] = math.inf
    scaler.update()
    scaler.scale(a.sum())
    scaler.step(opt)
    assert scaler.last_step_skipped(opt)


def test_overflow_from_the_unscale_multiply_is_detected() -> None:
    """With a scale below 1 the division can overflow; torch's kernel misses it."""
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    ours = mixprec.GradScaler(init_scale=0.125)
    theirs = torch.amp.GradScaler("cpu", init_scale=0.125)
    for scaler in (ours, theirs):
        scaler.scale(p.sum())
        p.grad = torch.tensor([3e38, 1.0])
        scaler.unscale_(opt)
        assert math.isinf(p.grad[0].item())
    assert ours._phases.get(opt).found_inf_per_device[torch.device("cpu")].item() == 1.0
    assert (
        theirs._per_optimizer_states[id(opt)]["found_inf_per_device"][torch.device("cpu")].item()
        == 0.0
    )  # torch's input-only check misses it


def test_numpy_scalars_are_accepted_like_python_numbers() -> None:
    np = pytest.importorskip("numpy", reason="numpy is part of the [test] extra")
    scaler = mixprec.GradScaler(init_scale=np.float32(1024.0), growth_interval=np.int64(10))
    assert scaler.get_scale() == 1024.0 and scaler.get_growth_interval() == 10
    scaler.set_growth_factor(np.float64(4.0))
    sd = {k: (np.float64(v) if isinstance(v, float) else v) for k, v in scaler.state_dict().items()}
    mixprec.GradScaler().load_state_dict(sd)
    with pytest.raises(ConfigError):
        mixprec.GradScaler(growth_interval=np.float64(2.5))


def test_load_state_dict_mid_iteration_is_refused() -> None:
    model, opt = _model_and_opt()
    scaler = mixprec.GradScaler()
    saved = scaler.state_dict()
    _backward(scaler, model)
    scaler.unscale_(opt)
    with pytest.raises(mixprec.errors.ScalerStateError, match="mid-iteration"):
        scaler.load_state_dict(saved)
    scaler.step(opt)
    scaler.update()
    scaler.load_state_dict(saved)
