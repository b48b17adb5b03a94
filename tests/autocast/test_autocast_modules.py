"""Module rules on real model shapes: containers, model surgery, and nothing kept after the region
(#23 cases 3, 4 and 5). Eager; tests/autocast/test_autocast_compile.py has the compiled side."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy
from mixprec.errors import ConfigError

BF16 = torch.bfloat16


class Stack(nn.Module):
    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(n))
        self.heads = nn.ModuleDict({"a": nn.Linear(d, 2), "b": nn.Linear(d, 2)})

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for layer in self.layers:
            x = layer(x)
        return {k: head(x) for k, head in self.heads.items()}


def dtypes_seen(model: nn.Module, policy: Policy | str, x: torch.Tensor) -> dict[str, torch.dtype]:
    """The output dtype of every Linear, by qualified name, in a bf16 region under ``policy``."""
    seen: dict[str, torch.dtype] = {}
    handles = [
        m.register_forward_hook(lambda _m, _a, out, n=n: seen.__setitem__(n, out.dtype))
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]
    try:
        with mixprec.autocast("cpu", BF16, policy=policy):
            model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


# ------------------------------------------------------------------ containers (case 3)
@pytest.mark.parametrize("strict", [True, False])
def test_a_rule_on_a_module_list_reaches_every_block_and_resolve_agrees(strict: bool) -> None:
    model, x = Stack(), torch.randn(4, 8)
    policy = Policy("layers=fp32", strict=strict)
    assert policy.resolve(model) == {"layers": mixprec.Rule("fp32")}
    seen = dtypes_seen(model, policy, x)  # strict: no "matched no module" for the container
    assert {n: d for n, d in seen.items() if n.startswith("layers")} == {
        f"layers.{i}.0": torch.float32 for i in range(3)
    }
    assert seen["heads.a"] == seen["heads.b"] == BF16


def test_a_rule_on_a_module_dict_and_the_innermost_rule_wins() -> None:
    model, x = Stack(), torch.randn(4, 8)
    seen = dtypes_seen(model, "heads=fp32, heads.b=fp16, layers.1=fp16", x)
    assert seen == {
        "layers.0.0": BF16,
        "layers.1.0": torch.float16,
        "layers.2.0": BF16,
        "heads.a": torch.float32,
        "heads.b": torch.float16,
    }


def test_an_fp8_rule_on_a_module_list_serves_every_linear_inside() -> None:
    model, x = Stack(), torch.randn(4, 8)
    policy = Policy("layers=fp8", strict=False)
    with mixprec.Fp8Stats() as stats, mixprec.autocast("cpu", BF16, policy=policy):
        model(x)
    assert sorted(stats.names) == [f"layers.{i}.0" for i in range(3)]


# ------------------------------------------------------------------ references (case 4)
@pytest.mark.parametrize("policy", ["nn.Linear=fp32", "layers.1=fp16, F.relu=fp32", "layers=fp8"])
def test_the_region_keeps_no_reference_to_the_model(policy: str) -> None:
    model = Stack()
    probe = weakref.ref(model)
    weight = weakref.ref(model.layers[0][0].weight)
    with mixprec.autocast("cpu", BF16, policy=Policy(policy, strict=False)):
        out = model(torch.randn(4, 8))
    del model, out
    gc.collect()
    assert probe() is None, gc.get_referrers(probe()) if probe() is not None else None
    assert weight() is None


def test_custom_function_outputs_are_not_kept_after_the_region() -> None:
    class Double(torch.autograd.Function):
        @staticmethod
        @mixprec.custom_fwd
        def forward(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def setup_context(ctx: object, inputs: object, output: object) -> None:
            pass

        @staticmethod
        @mixprec.custom_bwd
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            return grad * 2

    x = torch.randn(3, requires_grad=True)
    with mixprec.autocast("cpu", BF16):
        y = Double.apply(x)
        z = y * 1
    probe = weakref.ref(y)
    del y  # its grad_fn lives on in z's graph; the tensor itself must go
    gc.collect()
    assert probe() is None
    z.sum().backward()  # custom_bwd still finds the forward's autocast state
    assert torch.equal(x.grad, torch.full((3,), 2.0))


# ------------------------------------------------------------------ model surgery (case 5)
def test_names_follow_modules_dropped_from_a_module_list() -> None:
    model, x = Stack(), torch.randn(4, 8)
    policy = Policy("layers.0=fp32, layers.1=fp16", strict=False)
    assert dtypes_seen(model, policy, x)["layers.0.0"] == torch.float32
    second = model.layers[1]
    model.layers = model.layers[1:]  # the old layers.1 is now layers.0
    assert model.layers[0] is second
    seen = dtypes_seen(model, policy, x)
    assert seen["layers.0.0"] == torch.float32 and seen["layers.1.0"] == torch.float16
    assert "layers.2.0" not in seen


def test_names_follow_swapped_and_reordered_modules() -> None:
    model, x = Stack(), torch.randn(4, 8)
    policy = Policy("heads.a=fp32, layers.2=fp16")
    assert dtypes_seen(model, policy, x)["heads.a"] == torch.float32
    model.heads.a, model.heads.b = model.heads.b, model.heads.a
    model.layers = nn.ModuleList(reversed(list(model.layers)))
    seen = dtypes_seen(model, policy, x)
    assert seen["heads.a"] == torch.float32 and seen["heads.b"] == BF16
    assert [seen[f"layers.{i}.0"] for i in range(3)] == [BF16, BF16, torch.float16]


def test_a_module_added_after_the_first_region_gets_its_rule() -> None:
    model, x = Stack(), torch.randn(4, 8)
    policy = Policy("layers.3=fp32", strict=False)
    dtypes_seen(model, policy, x)
    model.layers.append(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    assert dtypes_seen(model, policy, x)["layers.3.0"] == torch.float32


def test_strict_names_are_those_of_the_models_that_ran() -> None:
    model = Stack()
    with (
        pytest.raises(ConfigError, match=r"'layer\.\*' matched no module .*ran in the region"),
        mixprec.autocast("cpu", BF16, policy=Policy("layer.*=fp32")),
    ):
        model(torch.randn(4, 8))
