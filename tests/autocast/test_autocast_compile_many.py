"""Many models and policies in one process under torch.compile, both compile styles (#23).

tests/autocast/test_autocast_compile.py resets Dynamo before each case; here nothing is reset
between
steps, so what one compiled call leaves in Dynamo's caches (cache entries of mixprec's hooks, the
recompile limit of a frame) meets the next model and policy, as in a long-running process. Each
step builds fresh models and compares, bit for bit (``aot_eager``), an eager model, an in-place
``model.compile()`` and a ``torch.compile(model)`` wrapper run under the same policy, compiled
first or eager first. The sequence is longer than Dynamo's recompile limit (8).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from tests.autocast_helpers import MLP, assert_bitwise, run
from torch import nn
from torch._dynamo.utils import counters

import mixprec
from mixprec import Policy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global"),
]
BF16 = torch.bfloat16


def seq() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 32), nn.ReLU()), nn.Linear(32, 8)
    )


class Net(nn.Module):
    """A model whose forward is user code (``model.compile()`` compiles its frame; on a torch.nn
    container Dynamo skips torch's frames and compiles only the hooks it calls)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)).relu())


SPECS = {
    "seq": [
        "2.0=fp32", "nn.Linear=bf16", "2.0=fp32", "3=fp32", "nn.Linear=fp32", "0=fp16",
        "2=fp32, 3=fp16", "nn.ReLU=fp32", "F.relu=fp32", "nn.Linear=fp8", "0=keep", "3=fp32",
    ],
    "net": [
        "body.0=fp32", "nn.Linear=bf16", "head=fp32", "norm=fp16", "body=fp32", "nn.Linear=fp32",
        "body.2=fp16, head=fp32", "nn.LayerNorm=fp32", "F.layer_norm=fp32", "head=fp8",
        "body=keep", "head=fp32",
    ],
}  # fmt: skip


@pytest.mark.parametrize("kind", list(SPECS))
def test_many_models_and_policies_in_one_process(kind: str) -> None:
    """The review's reproduction, extended: from the third policy on, both compiled variants
    gave wrong dtypes and values (stale cache entries of the hooks past the recompile limit)."""
    torch._dynamo.reset()
    make = {"seq": seq, "net": Net}[kind]
    x = torch.randn(4, 16)
    for step, spec in enumerate(SPECS[kind]):
        policy = Policy(spec)
        eager, inplace, wrapped = make(), make(), torch.compile(make(), backend="aot_eager")
        inplace.compile(backend="aot_eager")
        want = run(eager, x, policy)
        if step % 2:  # eager first, then compiled: the same models run once eagerly before
            with torch.compiler.set_stance("force_eager"):
                run(inplace, x, policy)
                run(wrapped, x, policy)
        for call in range(2):
            what = f"{kind} step {step} {spec!r} call {call}"
            assert_bitwise(run(inplace, x, policy), want, f"{what}, model.compile()")
            assert_bitwise(run(wrapped, x, policy), want, f"{what}, torch.compile")


def test_one_compiled_model_through_many_policies_and_back() -> None:
    """One in-place compiled model and one wrapper switched through more policies than the
    recompile limit, then back through them: each call equals the eager model's."""
    torch._dynamo.reset()
    x = torch.randn(4, 16)
    eager, inplace, wrapped = Net(), Net(), torch.compile(Net(), backend="aot_eager")
    inplace.compile(backend="aot_eager")
    specs = SPECS["net"]
    for spec in [*specs, *reversed(specs)]:
        want = run(eager, x, Policy(spec))
        assert_bitwise(run(inplace, x, Policy(spec)), want, f"{spec}, in place")
        assert_bitwise(run(wrapped, x, Policy(spec)), want, f"{spec}, wrapper")


def test_the_hooks_are_never_compiled_on_their_own() -> None:
    """``model.compile()`` of a torch.nn container: Dynamo skips torch's frames, so before the
    fix it compiled mixprec's hooks as frames of their own (one per module type); now no frame of
    mixprec's code is compiled, inside the region or around it."""
    torch._dynamo.reset()
    torch._dynamo.utils.clear_compilation_metrics()
    model = seq()
    model.compile(backend="aot_eager")
    with mixprec.autocast("cpu", BF16, policy="3=fp32, nn.ReLU=fp16, F.relu=fp32"):
        model(torch.randn(4, 16))
    compiled = {(m.co_name, m.co_filename) for m in torch._dynamo.utils.get_compilation_metrics()}
    ours = {c for c in compiled if "mixprec" in str(c[1])}
    assert not ours, ours


def test_a_policy_switch_of_an_in_place_compiled_model_costs_one_graph() -> None:
    """The figure docs/autocast.md quotes for ``model.compile()``: a new policy compiles one
    graph, a policy seen before none."""
    torch._dynamo.reset()
    model, x = MLP(), torch.randn(4, 16)
    model.compile(backend="aot_eager")
    found = []
    for spec in ("fc1=fp32", "nn.Linear=fp16", "fc1=fp32", "nn.Linear=fp16"):
        before = counters["stats"]["unique_graphs"]
        run(model, x, Policy(spec))
        found.append(counters["stats"]["unique_graphs"] - before)
    assert found == [1, 1, 0, 0]


@pytest.mark.parametrize(
    ("spec", "want"), [(None, [1, 0, 0]), ("F.gelu=fp32", [1, 0, 0]), ("fc1=fp32", [1, 0, 0])]
)
@pytest.mark.parametrize("style", ["model.compile()", "torch.compile(model)"])
def test_what_a_fresh_model_of_the_same_class_costs(
    style: str, spec: str | None, want: list[int]
) -> None:
    """The figures docs/autocast.md quotes: a fresh model of the same class reuses the graph of
    the first, without a policy, with op rules and with module rules (a compiled model's rules
    are guarded by their values, not by the module instances)."""
    torch._dynamo.reset()
    x, found = torch.randn(4, 16), []
    for _ in range(3):
        model = MLP()
        if style == "model.compile()":
            model.compile(backend="aot_eager")
        else:
            model = torch.compile(model, backend="aot_eager")
        before = counters["stats"]["unique_graphs"]
        with mixprec.autocast("cpu", BF16, policy=spec):
            model(x)
        found.append(counters["stats"]["unique_graphs"] - before)
    assert found == want


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x).relu()
        return x


@pytest.mark.parametrize("style", ["model.compile()", "torch.compile(model)"])
def test_compiled_rules_follow_swapped_and_dropped_blocks(style: str) -> None:
    """A name rule belongs to the block that sits at that name now, in the compiled model as in
    the eager one (docs/autocast.md)."""
    torch._dynamo.reset()
    eager, x = Blocks(), torch.randn(4, 16)
    model = Blocks()
    compiled: nn.Module = model
    if style == "model.compile()":
        model.compile(backend="aot_eager")
    else:
        compiled = torch.compile(model, backend="aot_eager")
    policy = Policy("blocks.0=fp32, blocks.1=fp16")
    for step in range(4):
        want = run(eager, x, policy)
        assert_bitwise(run(compiled, x, policy), want, f"{style} step {step}")
        for net in (eager, model):
            if step == 2:
                net.blocks = net.blocks[1:]  # drop the first block
            else:
                net.blocks = nn.ModuleList([net.blocks[1], net.blocks[0], *net.blocks[2:]])
