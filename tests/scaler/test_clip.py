"""scaler.clip_grad_norm_ / clip_grad_value_ against torch's unscale_ + clip sequence.

The oracle is ``torch.amp.GradScaler("cpu")``: ``unscale_(opt)`` then
``torch.nn.utils.clip_grad_norm_`` (or ``clip_grad_value_``) then ``step``/``update``. With a
power-of-two scale the results are bit-identical; tests that change the scale to a non-power of two
compare to float32 rounding.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mixprec
from mixprec.errors import (
    ConfigError,
    LowPrecisionGradError,
    MissingGradError,
    ScalerStateError,
)

# Every test runs on the CPU's path and on the path a CUDA user takes (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("scaler_path")

SHAPES = [(5, 3), (7,), (2, 2, 2), (1,), (33,)]


def make_params(
    seed: int, scale: float, dtype: torch.dtype = torch.float32, shapes: list | None = None
) -> list[torch.nn.Parameter]:
    """Parameters with ``scale``-times-larger grads, as after ``scaler.scale(loss).backward()``."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes or SHAPES:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype))
        p.grad = torch.randn(shape, generator=gen, dtype=dtype) * scale
        params.append(p)
    return params


def inject(params: list[torch.nn.Parameter], value: float | None) -> None:
    if value is not None:
        params[2].grad.view(-1)[3] = value


def torch_sequence(params, scale, max_norm, norm_type, flat=False):
    """(norm, grads after clipping, params after step, scale after update) with torch."""
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    grads = [p.grad.clone() for p in params]
    scaler.step(opt)
    scaler.update()
    return norm, grads, [p.detach().clone() for p in params], scaler.get_scale()


def mixprec_sequence(params, scale, max_norm, norm_type, flat=False):
    if flat:
        mixprec.flatten_grads(params)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = mixprec.GradScaler(init_scale=scale)
    scaler.scale(torch.ones(()))
    norm = scaler.clip_grad_norm_(opt, max_norm, norm_type)
    grads = [p.grad.clone() for p in params]
    scaler.step(opt)
    scaler.update()
    return norm, grads, [p.detach().clone() for p in params], scaler.get_scale()


def assert_close(a: torch.Tensor, b: torch.Tensor, exact: bool) -> None:
    if exact:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-30, equal_nan=True)


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0, 3.5])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("bad", [None, math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("flat", [False, True])
def test_clip_norm_matches_torch(norm_type, max_norm, bad, flat):
    scale = 2.0**14
    mine, ref = make_params(0, scale), make_params(0, scale)
    inject(mine, bad)
    inject(ref, bad)
    expected = torch_sequence(ref, scale, max_norm, norm_type)
    got = mixprec_sequence(mine, scale, max_norm, norm_type, flat=flat)
    # Flat grads sum the norm in another order, and pow() with a fractional p is not exactly
    # homogeneous: float32 rounding there, bits otherwise.
    exact = norm_type == math.inf or (not flat and norm_type in (1.0, 2.0))
    assert_close(got[0], expected[0], exact)
    for a, b in zip(got[1] + got[2], expected[1] + expected[2], strict=True):
        assert_close(a, b, exact)
    assert got[3] == expected[3]  # same skip decision, hence the same next scale
    assert (bad is None) == (got[3] == scale)


# scales below 1 on purpose
@pytest.mark.filterwarnings("ignore::mixprec.errors.ScaleCollapseWarning")
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    log_scale=st.integers(-3, 24),
    odd_scale=st.booleans(),
    max_norm=st.floats(1e-3, 1e3),
    norm_type=st.sampled_from([2.0, 1.0, math.inf, 0.5, 4.0]),
)
def test_clip_norm_property(seed, log_scale, odd_scale, max_norm, norm_type):
    """Any scale (powers of two bit-identical, others to float32 rounding) and any p > 0."""
    scale = 2.0**log_scale * (1.37 if odd_scale else 1.0)
    mine, ref = make_params(seed, scale), make_params(seed, scale)
    expected = torch_sequence(ref, scale, max_norm, norm_type)
    got = mixprec_sequence(mine, scale, max_norm, norm_type)
    exact = not odd_scale and norm_type in (1.0, 2.0, math.inf)
    assert_close(got[0], expected[0], exact)
    for a, b in zip(got[1], expected[1], strict=True):
        assert_close(a, b, exact)


def test_mixed_dtypes_match_torch():
    shapes = [(4, 3), (5,)]
    for norm_type in (2.0, math.inf):
        mine, ref = (
            make_params(1, 256.0, shapes=shapes) + make_params(2, 256.0, torch.float64, shapes)
            for _ in range(2)
        )
        expected = torch_sequence(ref, 256.0, 0.1, norm_type)
        got = mixprec_sequence(mine, 256.0, 0.1, norm_type)
        assert got[0].dtype == expected[0].dtype == torch.float64
        assert_close(got[0], expected[0], exact=True)
        for x, y in zip(got[1], expected[1], strict=True):
            assert_close(x, y, exact=True)


@pytest.mark.parametrize("bad", [None, math.inf, math.nan])
@pytest.mark.parametrize("flat", [False, True])
def test_clip_value_matches_torch(bad, flat):
    scale = 2.0**10
    mine, ref = make_params(3, scale), make_params(3, scale)
    inject(mine, bad)
    inject(ref, bad)
    t_opt = torch.optim.SGD(ref, lr=0.1)
    t_scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    t_scaler.scale(torch.ones(()))
    t_scaler.unscale_(t_opt)
    torch.nn.utils.clip_grad_value_(ref, 0.3)
    if flat:
        mixprec.flatten_grads(mine)
    m_opt = torch.optim.SGD(mine, lr=0.1)
    m_scaler = mixprec.GradScaler(init_scale=scale)
    m_scaler.scale(torch.ones(()))
    m_scaler.clip_grad_value_(m_opt, 0.3)
    for a, b in zip(mine, ref, strict=True):
        assert_close(a.grad, b.grad, exact=True)
    t_scaler.step(t_opt)
    m_scaler.step(m_opt)
    assert m_scaler.last_step_skipped() == (bad is not None)
    for a, b in zip(mine, ref, strict=True):
        assert_close(a.detach(), b.detach(), exact=True)


# ---------------------------------------------------------------------------- a training run


def train(clip_call, inject_at: dict[int, float], optimizer: str) -> tuple[list, list]:
    """A tiny fp16-autocast run; ``clip_call(scaler, opt, params)`` clips after backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    kwargs = {"fused": True} if optimizer == "adam-fused" else {"foreach": False}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **kwargs)
    scaler_cls = torch.amp.GradScaler if clip_call is torch_clip else mixprec.GradScaler
    scaler = scaler_cls("cpu", init_scale=2.0**16, growth_interval=2)
    gen = torch.Generator().manual_seed(1)
    scales, norms = [], []
    for it in range(8):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if it in inject_at:
            with torch.no_grad():
                model[2].weight.grad[0, 0] = inject_at[it]
        norms.append(clip_call(scaler, opt, list(model.parameters())))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, norms + [p.detach() for p in model.parameters()]


def torch_clip(scaler, opt, params):
    scaler.unscale_(opt)
    return torch.nn.utils.clip_grad_norm_(params, 0.05)


def mixprec_clip(scaler, opt, params):
    return scaler.clip_grad_norm_(opt, 0.05)


@pytest.mark.parametrize("optimizer", ["adam", "adam-fused"])
def test_training_run_bit_identical(optimizer):
    inject_at = {2: math.inf, 5: math.nan}
    t_scales, t_values = train(torch_clip, inject_at, optimizer)
    m_scales, m_values = train(mixprec_clip, inject_at, optimizer)
    assert m_scales == t_scales
    assert any(b < a for a, b in itertools.pairwise(t_scales))  # backed off
    assert any(b > a for a, b in itertools.pairwise(t_scales))  # grew
    for a, b in zip(m_values, t_values, strict=True):
        assert_close(a, b, exact=True)


# ---------------------------------------------------------------------------- protocol


def ready(scale: float = 2.0**16, **kwargs):
    params = make_params(4, scale)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = mixprec.GradScaler(init_scale=scale, **kwargs)
    scaler.scale(torch.ones(()))
    return params, opt, scaler


def test_step_skips_after_non_finite_clip():
    params, opt, scaler = ready()
    inject(params, math.inf)
    before = [p.detach().clone() for p in params]
    norm = scaler.clip_grad_norm_(opt, 1.0)
    assert not torch.isfinite(norm)
    assert scaler.step(opt) is None
    assert scaler.last_step_skipped()
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True))
    scaler.update()
    assert scaler.get_scale() == 2.0**15


def test_clip_twice_and_after_unscale_or_step_raise():
    _params, opt, scaler = ready()
    scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(ScalerStateError, match=r"clip_grad_norm_\(\).*already been called"):
        scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(ScalerStateError):
        scaler.clip_grad_value_(opt, 1.0)
    with pytest.raises(ScalerStateError):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(ScalerStateError, match="after step"):
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.update()
    _params, opt, scaler = ready()
    scaler.unscale_(opt)
    with pytest.raises(ScalerStateError, match="already been called"):
        scaler.clip_grad_norm_(opt, 1.0)


def test_clip_before_scale_raises():
    params = make_params(0, 1.0)
    scaler = mixprec.GradScaler()
    with pytest.raises(ScalerStateError, match=r"before scaler\.scale"):
        scaler.clip_grad_norm_(torch.optim.SGD(params, lr=0.1), 1.0)


def test_error_if_nonfinite_raises_and_changes_nothing():
    params, opt, scaler = ready()
    inject(params, math.nan)
    grads = [p.grad.clone() for p in params]
    with pytest.raises(mixprec.errors.NonFiniteNormError, match="non-finite") as info:
        scaler.clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)
    assert isinstance(info.value, RuntimeError)  # what torch raises
    for g, p in zip(grads, params, strict=True):
        assert_close(p.grad, g, exact=True)
    assert scaler.step(opt) is None  # step unscales, finds the NaN and skips
    _finite_params, opt, scaler = ready()
    norm = scaler.clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)
    assert torch.isfinite(norm)


def test_fp16_and_sparse_grads_rejected_untouched():
    params, opt, scaler = ready()
    half = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    half.grad = torch.full((3,), 1024.0, dtype=torch.float16)
    opt = torch.optim.SGD([("w", params[0]), ("half", half)], lr=0.1)
    with pytest.raises(LowPrecisionGradError, match="half"):
        scaler.clip_grad_norm_(opt, 1.0)
    assert half.grad.eq(1024.0).all()
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().mul(1024.0).backward()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="sparse"):
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.unscale_(opt)  # the optimizer was left READY


@pytest.mark.parametrize("norm_type", [0, -1.0, math.nan, "two", -math.inf])
def test_bad_norm_type(norm_type):
    _params, opt, scaler = ready()
    with pytest.raises(ConfigError, match="norm_type"):
        scaler.clip_grad_norm_(opt, 1.0, norm_type)


@pytest.mark.parametrize("value", [-1.0, math.nan, None])
def test_bad_limits(value):
    _params, opt, scaler = ready()
    with pytest.raises(ConfigError, match="max_norm"):
        scaler.clip_grad_norm_(opt, value)
    with pytest.raises(ConfigError, match="clip_value"):
        scaler.clip_grad_value_(opt, value)


def test_empty_grads_are_ignored_by_every_norm():
    """torch's inf-norm raises on an empty grad; it contributes nothing, so mixprec skips it."""
    for norm_type in (2.0, math.inf):
        mine, ref = make_params(6, 8.0), make_params(6, 8.0)
        empty = torch.nn.Parameter(torch.zeros(0))
        empty.grad = torch.zeros(0)
        expected = torch_sequence(ref, 8.0, 0.5, norm_type)
        got = mixprec_sequence([*mine, empty], 8.0, 0.5, norm_type)
        assert_close(got[0], expected[0], exact=True)


def test_no_grads_then_step_raises_like_unscale():
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = mixprec.GradScaler()
    scaler.scale(torch.ones(()))
    assert float(scaler.clip_grad_norm_(opt, 1.0)) == 0.0
    with pytest.raises(MissingGradError, match=r"has a \.grad"):
        scaler.step(opt)


def test_overflow_from_unscaling_below_one_is_caught():
    """Scale 2**-8: finite scaled grads whose unscaled values overflow (torch steps on NaN)."""
    params, opt, scaler = ready(scale=2.0**-8, min_scale=2.0**-10)
    params[1].grad[0] = 3e38 / 16  # * 256 overflows float32
    scaler.clip_grad_norm_(opt, 1.0)
    assert scaler.step(opt) is None


def test_disabled_scaler_clips_like_torch():
    mine, ref = make_params(5, 1.0), make_params(5, 1.0)
    scaler = mixprec.GradScaler(enabled=False)
    norm = scaler.clip_grad_norm_(torch.optim.SGD(mine, lr=0.1), 0.5)
    assert_close(norm, torch.nn.utils.clip_grad_norm_(ref, 0.5), exact=True)
    scaler.clip_grad_value_(torch.optim.SGD(mine, lr=0.1), 0.01)
    torch.nn.utils.clip_grad_value_(ref, 0.01)
    for a, b in zip(mine, ref, strict=True):
        assert_close(a.grad, b.grad, exact=True)


# ---------------------------------------------------------------------------- parameter order


def _grouped_like_nanogpt(model: torch.nn.Module, fused: bool = False) -> torch.optim.Optimizer:
    """Weight decay on matrices only: the optimizer lists parameters in another order."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, fused=fused)


def _grouped_run(clip_call, steps: int = 6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    opt = _grouped_like_nanogpt(model)
    is_torch = clip_call is _torch_model_order
    scaler = (torch.amp.GradScaler if is_torch else mixprec.GradScaler)("cpu", growth_interval=2)
    gen = torch.Generator().manual_seed(3)
    norms = []
    for it in range(steps):
        x = torch.randn(32, 16, generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean() * 100
        scaler.scale(loss).backward()
        if it == 3:
            with torch.no_grad():
                model[1].bias.grad[0] = math.inf
        norms.append(clip_call(scaler, opt, model))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return norms + [p.detach() for p in model.parameters()]


def _torch_model_order(scaler, opt, model):
    scaler.unscale_(opt)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)


def test_parameters_give_torch_s_summation_order():
    """nanoGPT and timm group parameters by weight decay; torch sums the norm in model order."""
    expected = _grouped_run(_torch_model_order)
    got = _grouped_run(lambda s, o, m: s.clip_grad_norm_(o, 0.1, parameters=m.parameters()))
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b, exact=True)


def test_parameters_must_be_the_optimizer_s():
    params, opt, scaler = ready()
    stranger = torch.nn.Parameter(torch.ones(2))
    stranger.grad = torch.ones(2)
    with pytest.raises(ConfigError, match=r"1 are not the optimizer's, and 1 of the optimizer's"):
        scaler.clip_grad_norm_(opt, 1.0, parameters=[*params[1:], stranger])
    scaler.clip_grad_norm_(opt, 1.0, parameters=reversed(params))  # any order of the same ones


# ---------------------------------------------------------------------------- clip in the step


def _folded_run(fused: bool, in_step: bool, steps: int = 12):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = mixprec.GradScaler(growth_interval=3)
    gen = torch.Generator().manual_seed(1)
    skipped, seen = [], []
    for it in range(steps):
        x = torch.randn(16, 8, generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if it in (4, 9):
            with torch.no_grad():
                model[2].weight.grad[0, 0] = math.nan if it == 9 else math.inf
        scaled = model[0].weight.grad.clone()
        scaler.clip_grad_norm_(opt, 0.05, in_step=in_step)
        seen.append(torch.equal(model[0].weight.grad, scaled))
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.last_step_skipped())
        opt.zero_grad()
    return skipped, seen, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_clipping_in_the_step_matches_clipping_before_it(fused):
    skipped, seen, params = _folded_run(fused, in_step=True)
    ref_skipped, ref_seen, ref_params = _folded_run(fused, in_step=False)
    assert skipped == ref_skipped and skipped[4] and skipped[9] and not any(skipped[:4])
    assert all(seen) and not any(ref_seen)  # until the step, .grad holds the scaled grads
    for a, b in zip(params, ref_params, strict=True):
        # the fused kernel divides by scale / c where the unfolded path multiplies by c / scale
        if fused:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        else:
            assert_close(a, b, exact=True)


def test_clipping_in_the_step_counts_as_unscale():
    params, opt, scaler = ready()
    scaler.clip_grad_norm_(opt, 1.0, in_step=True)
    with pytest.raises(ScalerStateError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    assert float(norm) == pytest.approx(1.0, rel=1e-5)  # non-fused: clipped before the step
