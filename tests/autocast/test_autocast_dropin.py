"""mixprec.autocast next to torch.autocast: defaults, float32, misuse, errors, warnings."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from mixprec.errors import ConfigError, MixprecError, RegionStateError, UnsupportedDeviceError

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


@contextmanager
def quiet() -> Iterator[None]:
    """Silence torch's own warnings (CUDA missing, dtype unsupported) in a differential."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def state(device: str = "cpu") -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)


def inside(region: AbstractContextManager[Any], device: str = "cpu") -> tuple[object, ...]:
    lin = nn.Linear(4, 4)
    with region:
        out = lin(torch.randn(2, 4))
        return (*state(device), out.dtype)


# ------------------------------------------------------------------ default dtype
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_default_dtype_is_torchs_for_the_device(device: str) -> None:
    with quiet():
        ours, theirs = mixprec.autocast(device), torch.autocast(device)
    assert ours.fast_dtype == theirs.fast_dtype == (BF16 if device == "cpu" else FP16)


def test_default_dtype_follows_an_enclosing_region_like_torch() -> None:
    with torch.autocast("cpu", dtype=FP16):
        assert mixprec.autocast("cpu").fast_dtype == torch.autocast("cpu").fast_dtype == FP16
        assert inside(mixprec.autocast("cpu")) == inside(torch.autocast("cpu"))


def test_no_device_at_all_keeps_float16_as_torch_cuda_amp_autocast() -> None:
    with quiet():
        legacy = torch.cuda.amp.autocast()  # the 1.5 call form: float16 unless told
    assert mixprec.autocast().fast_dtype == legacy.fast_dtype == FP16


def _lstm_step(region: Callable[[], AbstractContextManager[Any]]) -> list[torch.Tensor] | str:
    torch.manual_seed(0)
    lstm, x = nn.LSTM(8, 16, batch_first=True), torch.randn(2, 5, 8)
    try:
        with region():
            out, _ = lstm(x)
        out.float().sum().backward()
    except RuntimeError as err:  # oneDNN has no low-precision LSTM kernel for some CPUs
        return f"RuntimeError: {str(err)[:60]}"
    return [out.detach(), *(p.grad for p in lstm.parameters() if p.grad is not None)]


def test_an_lstm_under_the_cpu_default_behaves_as_under_torchs() -> None:
    theirs = _lstm_step(lambda: torch.autocast("cpu"))
    ours = _lstm_step(lambda: mixprec.autocast("cpu"))
    if isinstance(theirs, str):  # this CPU cannot run it in bf16: mixprec fails the same way
        assert ours == theirs
        return
    assert not isinstance(ours, str) and theirs[0].dtype == BF16
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


# ------------------------------------------------------------------ float32 and enabled=False
@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("dtype", [FP32, BF16, FP16, None])
def test_the_amp_dtype_and_use_amp_pattern_matches_torch(
    dtype: torch.dtype | None, enabled: bool
) -> None:
    """`autocast(device, dtype=amp_dtype, enabled=use_amp)`, as training scripts write it."""
    with quiet():
        theirs = inside(torch.autocast("cpu", dtype=dtype, enabled=enabled))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float32 is a request, not a mistake: no warning
        ours = inside(mixprec.autocast("cpu", dtype=dtype, enabled=enabled))
    assert ours == theirs
    if dtype == FP32:
        assert ours == (False, FP32, FP32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_with_enabled_false_any_dtype_is_accepted_as_torch(dtype: torch.dtype) -> None:
    assert inside(mixprec.autocast("cpu", dtype, enabled=False)) == inside(
        torch.autocast("cpu", dtype, enabled=False)
    )
    with pytest.raises(ConfigError, match=r"accepted: torch\.float16, torch\.bfloat16"):
        mixprec.autocast("cpu", dtype)  # enabled: a clear error, where torch warns and disables


def test_float32_inside_a_low_precision_region_turns_casting_off() -> None:
    with mixprec.autocast("cpu", BF16):
        assert inside(mixprec.autocast("cpu", FP32)) == (False, FP32, FP32)
        assert state() == (True, BF16)


# ------------------------------------------------------------------ misuse and error types
def test_calling_the_region_on_a_non_callable_is_a_type_error_at_once() -> None:
    tensor = torch.ones(2)
    with pytest.raises(TypeError):
        torch.autocast("cpu")(tensor)
    with pytest.raises(TypeError, match=r"needs a callable, got Tensor.*with mixprec\.autocast"):
        mixprec.autocast("cpu")(tensor)  # type: ignore[type-var]


@pytest.mark.parametrize(
    ("decorate", "match"),
    [
        (lambda: mixprec.custom_fwd("cuda"), r"device_type='cuda'"),
        (lambda: mixprec.custom_fwd(42), "decorates a function, got int"),
        (lambda: mixprec.custom_fwd(torch.device("cpu")), r"device_type='cpu'"),
        (lambda: mixprec.custom_bwd("cpu"), r"device_type='cpu'"),
    ],
)
def test_custom_fwd_and_bwd_refuse_a_non_function_when_decorating(
    decorate: Callable[[], object], match: str
) -> None:
    with pytest.raises(TypeError, match=match):
        decorate()
    with pytest.raises(TypeError):
        torch.amp.custom_fwd("cuda")  # torch refuses too (device_type is keyword-only)


def test_an_unknown_device_is_a_runtime_error_as_with_torch_and_lists_the_devices() -> None:
    with pytest.raises(RuntimeError, match="tpu9"):
        torch.autocast("tpu9")
    with pytest.raises(RuntimeError) as info:
        mixprec.autocast("tpu9")
    err = info.value
    assert isinstance(err, UnsupportedDeviceError) and isinstance(err, MixprecError)
    assert isinstance(err, ConfigError)  # still a bad setting for code that catches those
    assert "accepted device types: cpu" in str(err) and "'tpu9'" in str(err)
    with pytest.raises(UnsupportedDeviceError):
        mixprec.custom_fwd(device_type="tpu9")


@pytest.mark.parametrize("flag", ["enabled", "cache_enabled", "report"])
@pytest.mark.parametrize("value", [0, 1, 0.0, 1.0, "yes"])
def test_a_non_bool_flag_is_a_config_error(flag: str, value: object) -> None:
    """0 and 1 compare equal to False and True, and are still refused: the flags are bools."""
    with pytest.raises(ConfigError, match=flag):
        mixprec.autocast("cpu", **{flag: value})  # type: ignore[arg-type]


# ------------------------------------------------------------------ lifecycle and warnings
def test_exit_without_enter_is_a_clear_error_that_leaves_the_state_alone() -> None:
    region = torch.autocast("cpu")
    with pytest.raises(AttributeError):  # torch: an AttributeError, after changing the nesting
        region.__exit__(None, None, None)
    torch.autocast_increment_nesting()  # give torch's decrement back
    ours = mixprec.autocast("cpu", policy="nn.Linear=fp32")
    for _ in range(2):
        with pytest.raises(RegionStateError, match="exited without being entered"):
            ours.__exit__(None, None, None)
        with ours:
            assert state() == (True, BF16)
    assert state() == (False, BF16)
    assert torch.autocast_increment_nesting() == 1  # the nesting counter is intact
    torch.autocast_decrement_nesting()
    assert isinstance(RegionStateError("x"), RuntimeError)


@NO_CUDA
def test_warnings_about_the_region_point_at_the_callers_line() -> None:
    with pytest.warns(UserWarning, match="CUDA is not available") as caught:
        region = mixprec.autocast("cuda")
    assert [w.filename for w in caught] == [__file__]
    assert region.enabled is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with region:  # entering does not warn again
            assert not torch.is_autocast_enabled("cuda")

    with pytest.warns(UserWarning, match="CUDA is not available") as caught:

        @mixprec.autocast("cuda")
        def f() -> bool:
            return torch.is_autocast_enabled("cuda")

    assert caught[0].filename == __file__
    assert f() is False


# ------------------------------------------------------------------ the native state switch
def _snap() -> tuple[bool, torch.dtype, bool]:
    return (*state(), torch.is_autocast_cache_enabled())


@pytest.mark.parametrize("under_mode", [False, True], ids=["direct", "function-mode"])
def test_regions_switch_the_native_state_as_torch_autocast_does(under_mode: bool) -> None:
    """Nested both ways, with torch's cache semantics asked for: the same state at every point."""

    class Passthrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    def run(outer: Callable[..., Any], inner: Callable[..., Any]) -> list[object]:
        seen: list[object] = [_snap()]
        with outer("cpu", dtype=FP16, cache_enabled=True):
            seen.append(_snap())
            with inner("cpu", dtype=BF16, enabled=False, cache_enabled=False):
                seen.append(_snap())
            seen.append(_snap())
        seen.append(_snap())
        seen.append(torch.autocast_increment_nesting())  # the nesting counter is back at 0
        torch.autocast_decrement_nesting()
        return seen

    mode = Passthrough() if under_mode else None
    with mode or warnings.catch_warnings():
        reference = run(torch.autocast, torch.autocast)
        for outer, inner in [
            (mixprec.autocast, torch.autocast),
            (torch.autocast, mixprec.autocast),
        ]:
            assert run(outer, inner) == reference
        assert run(mixprec.autocast, mixprec.autocast) == reference


def test_the_outermost_exit_clears_the_weight_cache_as_torch() -> None:
    """A cast cached in one region must not serve the next one (the weight changed between)."""
    results = []
    for region in (torch.autocast, mixprec.autocast):
        torch.manual_seed(0)
        lin, x = nn.Linear(4, 4), torch.randn(2, 4)
        with region("cpu", dtype=BF16, cache_enabled=True):
            lin(x)
        with torch.no_grad():
            lin.weight.mul_(2)
        with region("cpu", dtype=BF16, cache_enabled=True):
            results.append(lin(x))
    torch.manual_seed(0)
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    with torch.no_grad():
        lin.weight.mul_(2)
    with torch.autocast("cpu", dtype=BF16):
        fresh = lin(x)
    assert torch.equal(results[0], fresh) and torch.equal(results[1], fresh)
