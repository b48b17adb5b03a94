"""mixprec.autocast without a policy is torch.autocast: bitwise outputs and grads, same state."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
from tests.autocast_helpers import bitwise_equal, make, step

import mixprec
from mixprec.errors import ConfigError

BF16 = torch.bfloat16
LOW = [torch.float16, BF16]
KINDS = ["mlp", "cnn", "transformer"]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("kind", KINDS)
def test_bitwise_parity_with_torch_autocast(kind: str, dtype: torch.dtype) -> None:
    model, x, y = make(kind)
    out_t, grads_t = step(model, x, y, lambda: torch.autocast("cpu", dtype=dtype))
    out_m, grads_m = step(model, x, y, lambda: mixprec.autocast("cpu", dtype))
    assert out_t.dtype == dtype or kind == "transformer"  # the transformer ends in a mean
    assert bitwise_equal([out_t, *grads_t], [out_m, *grads_m])
    assert all(g.dtype == torch.float32 for g in grads_m)


def test_state_inside_matches_native_and_is_restored() -> None:
    before = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    with torch.autocast("cpu"):
        native = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    with mixprec.autocast("cpu"):
        ours = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    assert ours == native == (True, torch.bfloat16)
    assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == before


def test_default_device_and_dtype() -> None:
    ac = mixprec.autocast()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert ac.device == expected
    assert ac.fast_dtype == torch.float16


def test_decorator_and_reentrant_instance() -> None:
    ac = mixprec.autocast("cpu", torch.bfloat16)

    @ac
    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    a = torch.randn(4, 4)
    assert mm(a, a).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    with ac:
        with ac:
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.is_autocast_enabled("cpu")
        assert mm(a, a).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_nested_regions_with_different_dtypes_do_not_reuse_the_cache() -> None:
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with mixprec.autocast("cpu", torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16
        with mixprec.autocast("cpu", torch.float16):  # native autocast crashes here (cache)
            inner = lin(x)
        assert lin(x).dtype == torch.bfloat16
        with mixprec.autocast("cpu", enabled=False):
            assert lin(x).dtype == torch.float32
    assert inner.dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(lin(x), inner)


def test_native_nested_dtype_switch_still_crashes() -> None:
    """Documents why mixprec turns the cache off for dtype-switching nested regions."""
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x)
        with pytest.raises(RuntimeError), torch.autocast("cpu", dtype=torch.float16):
            lin(x)


def test_thread_local_like_native() -> None:
    seen: dict[str, object] = {}

    def worker() -> None:
        seen["enabled"] = torch.is_autocast_enabled("cpu")
        with mixprec.autocast("cpu", torch.bfloat16):
            seen["dtype"] = (torch.randn(2, 2) @ torch.randn(2, 2)).dtype

    with mixprec.autocast("cpu", torch.float16):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.float16
    assert seen == {"enabled": False, "dtype": torch.bfloat16}


def test_exception_restores_state() -> None:
    with pytest.raises(KeyError), mixprec.autocast("cpu", torch.bfloat16):
        raise KeyError("boom")
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16  # cpu default restored


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_compile_parity_and_rules_without_graph_breaks() -> None:
    """One compile test (cold start is expensive), region entered around the compiled model."""
    torch._dynamo.reset()
    model, x, y = make("mlp")
    compiled = torch.compile(model, backend="aot_eager")
    out_t, grads_t = step(compiled, x, y, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    out_m, grads_m = step(compiled, x, y, lambda: mixprec.autocast("cpu", torch.bfloat16))
    assert bitwise_equal([out_t, *grads_t], [out_m, *grads_m])
    policy = mixprec.Policy(modules={torch.nn.LayerNorm: "fp32"}, ops={"aten::gelu": "fp32"})
    eager = step(model, x, y, lambda: mixprec.autocast("cpu", torch.bfloat16, policy=policy))
    torch._dynamo.reset()
    with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    comp = step(compiled, x, y, lambda: mixprec.autocast("cpu", torch.bfloat16, policy=policy))
    assert bitwise_equal([comp[0], *comp[1]], [eager[0], *eager[1]])
    assert not bitwise_equal([comp[0]], [out_m])  # the rules changed the numerics

    def inside(ctx: Callable[[], AbstractContextManager[Any]]) -> torch.Tensor:
        def fn(inp: torch.Tensor) -> torch.Tensor:
            with ctx():
                return model(inp)

        torch._dynamo.reset()
        return torch.compile(fn, backend="aot_eager")(x)

    # Regions entered inside the compiled function: without a policy mixprec.autocast traces as
    # torch.autocast; with one it refuses loudly (its hooks and modes cannot be traced there).
    native_in = inside(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert bitwise_equal([native_in], [inside(lambda: mixprec.autocast("cpu"))])  # default: bf16
    lin = torch.nn.Linear(4, 4)

    def broken(inp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with mixprec.autocast("cpu", torch.bfloat16):
            first = lin(inp)
            torch._dynamo.graph_break()  # a break inside the region keeps its state
            return first, lin(first)

    assert [t.dtype for t in torch.compile(broken, backend="aot_eager")(x[:, :4])] == [BF16] * 2
    # A rule on the root module of a compiled model (bound before the compiled frame runs).
    root_policy = mixprec.Policy(modules={torch.nn.Linear: torch.float16})
    with mixprec.autocast("cpu", torch.bfloat16, policy=root_policy):
        assert torch.compile(lin, backend="aot_eager")(x[:, :4]).dtype == torch.float16
    with pytest.raises(ConfigError, match="around the compiled call"):
        inside(lambda: mixprec.autocast("cpu", torch.bfloat16, policy=policy))
    made_outside = mixprec.autocast("cpu", torch.bfloat16)
    with pytest.raises(ConfigError, match="created outside"):
        inside(lambda: made_outside)
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_parity_without_policy(reentrant: bool) -> None:
    from torch.utils.checkpoint import checkpoint

    model, x, y = make("transformer")
    x.requires_grad_(reentrant)

    def run(ctx: Callable[[], AbstractContextManager[Any]]) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with ctx():
            h = checkpoint(model.encoder, x, use_reentrant=reentrant)
            loss = torch.nn.functional.cross_entropy(model.head(model.norm(h)).mean(1), y)
        loss.backward()
        return [loss.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]

    native = run(lambda: torch.autocast("cpu", dtype=BF16))
    ours = run(lambda: mixprec.autocast("cpu", BF16))
    assert bitwise_equal(native, ours)
