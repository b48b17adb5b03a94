"""Variants of #36's surfaces that its own tests do not cover (an adversarial pass).

Regions exited out of order: a region exited while regions entered after it in the same thread
are still open (explicit ``__exit__`` calls, a generator suspended inside a region and closed or
collected inside another). The invariant: no bare exception, the inner regions are closed first
as their own exits would (their later exits do nothing), and once every region has exited torch
holds what it held before the first (hooks, modes, the autocast state of each device type, the
IPU flag a policy region borrows). Differential: the model's output inside each region that is
still open equals the same region entered alone.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
import torch._dynamo
from hypothesis import given, settings
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import mixprec

BF16 = torch.bfloat16
DEVICES = ("cpu", "cuda", "ipu", "xpu")
HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks")
KINDS = [None, "nn.LayerNorm=fp32", "nn.Linear=fp32", "F.relu=fp32", "report", "fp16"]


def snapshot() -> dict[str, Any]:
    state: dict[str, Any] = {n: list(getattr(nn_module, n).items()) for n in HOOK_DICTS}
    state["function modes"] = list(torch.overrides._get_current_function_mode_stack())
    state["dispatch modes"] = list(_get_current_dispatch_mode_stack())
    for dev in DEVICES:
        state[dev] = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
    state["cache"] = torch.is_autocast_cache_enabled()
    return state


def region(kind: str | None) -> mixprec.autocast:
    if kind == "report":
        return mixprec.autocast("cpu", BF16, report=True)
    if kind == "fp16":
        return mixprec.autocast("cpu", torch.float16)
    return mixprec.autocast("cpu", BF16, policy=kind)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 8))


@settings(max_examples=40, deadline=None)
@given(
    first=st.sampled_from(KINDS[1:5]),  # a full region (a region without a policy or a report
    # outside any is native autocast's state switch, exited out of order as torch's is)
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3),
    data=st.data(),
)
def test_regions_exited_in_any_order_leave_nothing_and_raise_nothing_bare(
    first: str, kinds: list[str | None], data: st.DataObject
) -> None:
    kinds = [first, *kinds]
    net, x = model(), torch.randn(2, 8)
    before = snapshot()
    regions = [region(k) for k in kinds]
    alive = list(range(len(regions)))  # open, in entry order: exiting one closes those after it
    # drawn before any region is entered: a draw may end the example (hypothesis' StopTest),
    # which would leave the regions open for every later test in the process
    order = data.draw(st.permutations(range(len(regions))))
    with torch.no_grad():
        for r in regions:
            r.__enter__()
            net(x)
        for i in order:
            regions[i].__exit__(None, None, None)
            alive = [j for j in alive if j < i]
            if alive:  # what is still open runs as those regions entered alone
                got = net(x)
                with Nest([region(kinds[j]) for j in alive]):
                    want = net(x)
                assert got.dtype == want.dtype and torch.equal(got, want), (kinds, order)
    assert snapshot() == before, (kinds, order)


class Nest:
    """Enter ``regions`` in order, exit them in reverse."""

    def __init__(self, regions: list[mixprec.autocast]) -> None:
        self.regions = regions

    def __enter__(self) -> None:
        for r in self.regions:
            r.__enter__()

    def __exit__(self, *exc: object) -> None:
        for r in reversed(self.regions):
            r.__exit__(*exc)


def test_a_generator_region_collected_inside_another_region_closes_it_first() -> None:
    net, x = model(), torch.randn(2, 8)
    before = snapshot()

    def gen() -> Iterator[None]:
        with mixprec.autocast("cpu", BF16, policy="nn.Linear=fp32"):
            yield

    it = gen()
    next(it)
    with torch.no_grad(), mixprec.autocast("cpu", torch.float16, policy="nn.LayerNorm=fp32"):
        del it
        gc.collect()  # the generator's region exits here, outside-in
        net(x)
    assert snapshot() == before


# ------------------------------------------------ per-block compile, an fp8 rule above the Linear
# A rule whose owner is the compiled block (or a container of blocks) opens its fp8 scope in the
# block's eager call; the block's compiled forward then runs inside that eager scope. Invariant:
# fullgraph holds (nothing of the eager scope's bookkeeping is traced), one graph per distinct
# rules, bitwise the eager model (aot_eager).
class Small(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.norm(x))


class Stack(nn.Module):
    def __init__(self, n: int = 4, d: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({str(i): Small(d) for i in range(n)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x


def _step(model: nn.Module, x: torch.Tensor, policy: str) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with mixprec.autocast("cpu", BF16, policy=policy):
        out = model(x)
    out.float().square().mean().backward()
    return [out.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "want_graphs"), [("layers.2=fp8", 2), ("layers=fp8", 1)])
def test_per_block_compile_under_an_fp8_rule_of_the_block_or_its_container(
    policy: str, want_graphs: int
) -> None:
    torch._dynamo.reset()
    eager, compiled = Stack(), Stack()
    for block in compiled.layers.values():
        block.compile(backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 3, 32, requires_grad=True)
    want = _step(eager, x, policy)
    before = counters["stats"]["unique_graphs"]
    got = _step(compiled, x, policy)
    assert counters["stats"]["unique_graphs"] - before == want_graphs
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), policy


@pytest.mark.parametrize("outer", [None, "fp16"])
def test_a_region_without_policy_exited_before_a_policy_region_inside_it(outer: str | None) -> None:
    net, x = model(), torch.randn(2, 8)
    before = snapshot()
    thin, full = region(outer), region("nn.LayerNorm=fp32")
    with torch.no_grad():
        thin.__enter__()
        full.__enter__()
        net(x)
        thin.__exit__(None, None, None)
        full.__exit__(None, None, None)
    assert snapshot() == before
