"""custom_fwd / custom_bwd (both Function styles, device inferred) and the seed examples."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.errors import ConfigError

BF16 = torch.bfloat16
STATES: list[tuple[bool, torch.dtype]] = []


def _state() -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")


class OldStyle(torch.autograd.Function):
    @staticmethod
    @mixprec.custom_fwd
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    @mixprec.custom_bwd
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        STATES.append(_state())
        a, b = ctx.saved_tensors
        return g @ b.t(), a.t() @ g


class NewStyleFp32(torch.autograd.Function):
    @staticmethod
    @mixprec.custom_fwd(cast_inputs=torch.float32)
    def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        STATES.append(_state())
        return a @ b

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*(t.to(output.dtype) for t in inputs))

    @staticmethod
    @mixprec.custom_bwd
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        STATES.append(_state())
        a, b = ctx.saved_tensors
        return g @ b.t(), a.t() @ g


class NewStyleAmbient(NewStyleFp32):
    @staticmethod
    @mixprec.custom_fwd
    def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        STATES.append(_state())
        return a @ b


def test_old_style_backward_runs_under_forward_state() -> None:
    STATES.clear()
    a = torch.randn(3, 3, requires_grad=True)
    with mixprec.autocast("cpu", BF16):
        out = OldStyle.apply(a, a)
    assert out.dtype == BF16
    out.float().sum().backward()
    assert STATES == [(True, BF16)]  # backward outside the region, bf16 restored (pytorch#87979)


def test_new_style_cast_inputs_runs_fp32_with_autocast_off() -> None:
    STATES.clear()
    a = torch.randn(3, 3, requires_grad=True)
    with mixprec.autocast("cpu", BF16):
        out = NewStyleFp32.apply(a.bfloat16(), a)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert STATES == [(False, BF16), (False, BF16)]
    assert a.grad is not None and a.grad.dtype == torch.float32


def test_new_style_ambient_state_reaches_backward() -> None:
    STATES.clear()
    a = torch.randn(3, 3, requires_grad=True)
    with mixprec.autocast("cpu", torch.float16):
        out = NewStyleAmbient.apply(a, a)
        other = NewStyleAmbient.apply(a, a)  # a second pending call before the first backward
    assert out.dtype == torch.float16
    (out.float().sum() + other.float().sum()).backward()
    assert [(True, torch.float16)] * 4 == STATES
    STATES.clear()
    NewStyleAmbient.apply(a, a).sum().backward()  # outside any region
    assert STATES == [(False, BF16)] * 2


def test_torch_decorators_fail_on_setup_context_style() -> None:
    """Why mixprec has its own: torch's custom_fwd assumes a ctx first argument (pytorch#132388)."""

    class TorchStyle(NewStyleFp32):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu")
        def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a @ b

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return g, g

    a = torch.randn(3, 3, requires_grad=True)
    with pytest.raises(AttributeError, match="_fwd_used_autocast"):
        TorchStyle.apply(a, a).sum().backward()


def test_custom_bwd_without_custom_fwd_raises() -> None:
    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
            return a * 2

        @staticmethod
        @mixprec.custom_bwd
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    with pytest.raises(ConfigError, match="decorate the Function's forward"):
        Bare.apply(torch.ones(2, requires_grad=True)).sum().backward()


def test_bad_custom_fwd_arguments() -> None:
    with pytest.raises(ConfigError, match="cast_inputs"):
        mixprec.custom_fwd(cast_inputs=torch.int32)
    with pytest.raises(ConfigError, match="accepted device types"):
        mixprec.custom_fwd(device_type="nodevice")


# ------------------------------------------------------------------ the seed's three examples
def _seed_run(
    lin_shape: tuple[int, int], n: int, opt: str, epochs: int, amp: bool, pass_opt: bool
) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(*lin_shape)
    cls = torch.optim.SGD if opt == "sgd" else torch.optim.Adam
    optimizer = cls(model.parameters(), lr=0.1 if lin_shape == (5, 3) else 0.01)
    scaler = mixprec.GradScaler(enabled=amp)
    data, target = torch.randn(n, lin_shape[0]), torch.randn(n, lin_shape[1])
    losses = []
    mm_dtypes = []
    hook = model.register_forward_hook(lambda m, a, out: mm_dtypes.append(out.dtype))
    for _ in range(epochs):
        optimizer.zero_grad()
        with mixprec.autocast(enabled=amp):
            output = model(data)
            loss = F.mse_loss(output, target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        if pass_opt:
            scaler.update(optimizer)  # as the seed writes it
        else:
            scaler.update()
        losses.append(loss.item())
    hook.remove()
    assert mm_dtypes == [torch.float16 if amp else torch.float32] * epochs
    return losses


@pytest.mark.parametrize(
    ("shape", "n", "opt", "epochs", "pass_opt"),
    [((10, 1), 5, "sgd", 1, True), ((10, 1), 20, "adam", 3, True), ((5, 3), 4, "sgd", 1, False)],
    ids=["update-optimizer", "epochs-adam", "update-no-arg"],
)
def test_seed_examples_with_real_fp16_on_cpu(
    shape: tuple[int, int], n: int, opt: str, epochs: int, pass_opt: bool
) -> None:
    if mixprec.autocast().device != "cpu":
        pytest.skip("the seed examples are checked on the CPU; this machine defaults to a GPU")
    amp = _seed_run(shape, n, opt, epochs, amp=True, pass_opt=pass_opt)
    ref = _seed_run(shape, n, opt, epochs, amp=False, pass_opt=pass_opt)
    assert all(torch.isfinite(torch.tensor(amp)))
    torch.testing.assert_close(torch.tensor(amp), torch.tensor(ref), rtol=1e-2, atol=1e-3)


def test_new_style_without_grad_holds_no_outputs() -> None:
    from mixprec._src.autocast import custom

    custom.bind_pending()
    a = torch.randn(3, 3)
    with mixprec.autocast("cpu", BF16):
        NewStyleAmbient.apply(a, a)
    assert not custom.has_pending()
