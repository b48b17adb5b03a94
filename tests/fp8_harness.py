"""The differential harness of #32, shared by tests/fp8/test_fp8_forms.py (the forms the issue
lists) and tests/fp8/test_fp8_variants.py (the adversarial variants): a module form runs under a
policy whose rule reaches it, and its output, its input's gradient and every parameter's gradient
are bitwise the oracle's (``tests/fp8_oracle.py``: the recipe's casts written out, not the code
under test) with the form's matmuls written by hand in its ``oracle(x, lin)``; or the run is a
ConfigError naming the module. Never the region's plain dtype: :func:`assert_not_plain` checks that
the oracle differs from it.

Interleaving: :func:`interleaved` runs two forwards of one model under two policies (the case's
rule, then the next rule of :data:`RULES`), then the first backward, then the second, each against
its oracle: reentrant checkpointing recomputes in the first backward, under the first forward's
rule, not the latest.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tests import fp8_oracle
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec
from mixprec.errors import ConfigError

BF16 = torch.bfloat16
D = 128  # every recipe's blocks tile it (128x128 weight blocks of fp8:blockwise)
RULES = {
    "fp8": "tensorwise",
    "fp8:rowwise": "rowwise",
    "fp8:rowwise_gw_hp": "rowwise_gw_hp",
    "fp8:blockwise": "blockwise",
    "mxfp8": "mxfp8",
    "nvfp4": "nvfp4",
}
# A forward eager, or checkpointed: reentrant, non-reentrant, and reentrant under saved-tensor
# hooks of the user's (``save_on_cpu``: they hid the reentrant checkpoint from mixprec, whose
# recomputation then ran unserved: wrong gradients without a word).
HOWS = ["eager", "reentrant", "non-reentrant", "reentrant-offloaded"]
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
PolicyFor = Callable[[str], "mixprec.Policy | str"]
COMPILE_WARNING = "ignore:Using `torch.compile\\(module\\)` when there are global"


def second_rule(rule: str) -> str:
    """The rule of the interleaved second forward: the next one of :data:`RULES`."""
    rules = list(RULES)
    return rules[(rules.index(rule) + 1) % len(rules)]


def run(model: Any, x: torch.Tensor, how: str) -> torch.Tensor:
    """One forward: eager, or under activation checkpointing (one of :data:`HOWS`)."""
    if how == "eager":
        return model(x)  # type: ignore[no-any-return]
    if how == "reentrant-offloaded":
        with torch.autograd.graph.save_on_cpu():
            return checkpoint(model, x, use_reentrant=True)  # type: ignore[no-any-return]
    return checkpoint(model, x, use_reentrant=how == "reentrant")  # type: ignore[no-any-return]


def grads(model: nn.Module, x: torch.Tensor, out: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """The output, the input's gradient and each parameter's gradient of one backward."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)  # nvfp4 rounds gradients stochastically: the same draws
    out.float().square().mean().backward()
    assert x.grad is not None
    got = [out.detach(), x.grad]
    return got + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def oracle(model: nn.Module, x: torch.Tensor, recipe: str, seed: int) -> list[torch.Tensor]:
    """What :func:`grads` gives for the form's ``oracle`` with the oracle's Linear."""

    def lin(inp: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return fp8_oracle.linear(inp, w, b, recipe, BF16)

    with torch.autocast("cpu", BF16, cache_enabled=False):
        out = model.oracle(x, lin)  # type: ignore[operator]
    return grads(model, x, out, seed)


def make_input(seed: int, shape: tuple[int, ...] = (2, 4, D)) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(shape).requires_grad_()


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} tensors, the oracle gives {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype, f"{what}: tensor {i} is {a.dtype}, the oracle gives {b.dtype}"
        assert torch.equal(a, b), f"{what}: tensor {i} differs from the oracle"


def interleaved(
    make: Callable[[], nn.Module],
    policy_for: PolicyFor,
    rule: str,
    how: str,
    wrap: Callable[[nn.Module], Any] | None = None,
    shape: tuple[int, ...] = (2, 4, D),
) -> None:
    """Forward under ``rule``, forward under the next rule, backward of each, vs the oracles."""
    torch.manual_seed(0)
    base = make()
    model = base if wrap is None else wrap(base)
    second = second_rule(rule)
    x1, x2 = make_input(1, shape), make_input(2, shape)
    outs = []
    for r, x in ((rule, x1), (second, x2)):
        with mixprec.autocast("cpu", BF16, policy=policy_for(r)):
            outs.append(run(model, x, how))
    got1, got2 = grads(base, x1, outs[0], 11), grads(base, x2, outs[1], 12)
    want1 = oracle(base, make_input(1, shape), RULES[rule], 11)
    want2 = oracle(base, make_input(2, shape), RULES[second], 12)
    assert_bitwise(got1, want1, f"under {rule} ({how}, interleaved with {second})")
    assert_bitwise(got2, want2, f"under {second} ({how}, after {rule})")


def refused(
    make: Callable[[], nn.Module],
    policy_for: PolicyFor,
    rule: str,
    how: str,
    match: str,
    wrap: Callable[[nn.Module], Any] | None = None,
    shape: tuple[int, ...] = (2, 4, D),
) -> None:
    """The run (forward and backward) is a ConfigError whose message matches ``match``."""
    torch.manual_seed(0)
    base = make()
    model = base if wrap is None else wrap(base)
    with pytest.raises(ConfigError, match=match):
        with mixprec.autocast("cpu", BF16, policy=policy_for(rule)):
            out = run(model, make_input(1, shape), how)
        out.float().sum().backward()


def assert_not_plain(make: Callable[[], nn.Module], shape: tuple[int, ...] = (2, 4, D)) -> None:
    """The form's oracle differs from the same model in the region's plain dtype, so a rule
    doing nothing fails the harness."""
    torch.manual_seed(0)
    model = make()
    plain = copy.deepcopy(model)
    with torch.autocast("cpu", BF16, cache_enabled=False):
        want = plain(make_input(1, shape))
    got = oracle(model, make_input(1, shape), "tensorwise", 0)[0]
    assert not torch.equal(got, want.detach())


def compile_once() -> Callable[[nn.Module], Any]:
    """A wrapper that compiles the model once (aot_eager), after a Dynamo reset."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled: dict[str, Any] = {}

    def wrap(model: nn.Module) -> Any:
        if "fn" not in compiled:
            compiled["fn"] = torch.compile(model, backend="aot_eager")
        return compiled["fn"]

    return wrap


def unique_graphs() -> int:
    """Dynamo's count of the graphs it compiled (to check that a compiled case compiled)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
