"""Policies under torch.compile: a compiled model computes what the eager model computes under the
same policy, whatever ran before (#23).

The differential harness runs small models (an MLP, a transformer block, a conv net, a model
whose blocks sit in an ``nn.ModuleList``) under class, name, op, fp8 and mixed policies, compiled
first, eager first then compiled, and with the policy switched between compiled calls, and compares
outputs and gradients with an eager twin of the model bit for bit (``aot_eager``; one inductor case
within its tolerance). Cold compiles cost about a second each on 2 cores, so each model's policies
share one compiled wrapper: its first call is the compiled-first case, the later ones switch.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch._dynamo
from tests.autocast_helpers import CNN, MLP, Block, assert_bitwise, graphs, run
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec
from mixprec import Policy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global"),
]
BF16 = torch.bfloat16


def seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


# ------------------------------------------------------------------ the cases of #23
@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("nn.Linear=fp8", "nn.Linear=bf16"),
        ("nn.Linear=fp8", "nn.Linear=fp8:rowwise"),
        ("nn.Linear=fp8", "nn.Linear=fp8, 2=bf16"),
        ("nn.Linear=fp32", "nn.Linear=bf16"),
    ],
)
def test_a_compiled_model_follows_a_policy_switch(first: str, second: str) -> None:
    """Case 1: eager step, compiled under the same policy, compiled under another one."""
    torch._dynamo.reset()
    model, twin, x = seq(), seq(), torch.randn(4, 8)
    want_first, want_second = run(twin, x, first), run(twin, x, second)
    compiled = torch.compile(model, backend="aot_eager")
    run(model, x, first)
    assert_bitwise(run(compiled, x, first), want_first, first)
    assert_bitwise(run(compiled, x, second), want_second, f"{first} -> {second}")


@pytest.mark.parametrize("policy", ["2=fp32", "0=fp16", "0=keep, 2=fp32@input"])
def test_name_rules_of_a_compiled_model_run_first(policy: str) -> None:
    """Case 2: the compiled model is the first thing run under the policy."""
    torch._dynamo.reset()
    model, twin, x = seq(), seq(), torch.randn(4, 8)
    compiled = torch.compile(model, backend="aot_eager")
    for call in range(2):
        assert_bitwise(run(compiled, x, policy), run(twin, x, policy), f"{policy}, call {call}")


def test_a_policy_switch_costs_one_graph_and_switching_back_none() -> None:
    """The figures docs/autocast.md quotes: a new policy compiles one graph (a recompile of the
    frame), a policy seen before takes its cached graph, and an equal policy built again is the
    same policy (no recompile)."""
    torch._dynamo.reset()
    model, twin, x = seq(), seq(), torch.randn(4, 8)
    compiled = torch.compile(model, backend="aot_eager")
    with graphs() as first:
        run(compiled, x, "nn.Linear=fp32")
    with graphs() as switch:
        assert_bitwise(run(compiled, x, "2=fp16"), run(twin, x, "2=fp16"), "switch")
    with graphs() as back:
        assert_bitwise(
            run(compiled, x, Policy("nn.Linear=fp32")), run(twin, x, "nn.Linear=fp32"), "back"
        )
    with graphs() as again:
        run(compiled, x, "2=fp16")
    assert (first["graphs"], switch["graphs"], back["graphs"], again["graphs"]) == (1, 1, 0, 0)


@pytest.mark.parametrize("policy", ["nn.Linear=fp32", "F.relu=fp32", "2=fp8"])
def test_a_graph_compiled_outside_policy_regions_is_not_reused_inside(policy: str) -> None:
    """Dynamo does not guard on module hooks: a graph compiled before any policy region (so with
    no mixprec hook in it) must not serve a policy region, nor a policy graph a plain region."""
    torch._dynamo.reset()
    model, twin, x = seq(), seq(), torch.randn(4, 8)
    compiled = torch.compile(model, backend="aot_eager")
    for region in (None, policy, None, policy):
        with mixprec.autocast("cpu", BF16, policy=region):
            got = compiled(x)
        with mixprec.autocast("cpu", BF16, policy=region):
            want = twin(x)
        assert_bitwise([got], [want], f"policy={region}")


def test_compiled_function_around_the_model_follows_the_policy() -> None:
    """A compiled function that calls the model (no compiled wrapper to see first)."""
    torch._dynamo.reset()
    model, twin, x = seq(), seq(), torch.randn(4, 8)

    @torch.compile(backend="aot_eager")
    def forward(inp: torch.Tensor) -> torch.Tensor:
        return model(inp) * 2

    for policy in ("2=fp32", "nn.Linear=fp16", "2=fp32"):
        with mixprec.autocast("cpu", BF16, policy=policy):
            got = forward(x)
        with mixprec.autocast("cpu", BF16, policy=policy):
            want = twin(x) * 2
        assert_bitwise([got], [want], policy)


def test_the_assume_constant_result_decorator_still_only_marks_the_function() -> None:
    """mixprec marks its trace-time rule lookup the way torch.compiler.assume_constant_result
    does, without importing torch._dynamo at `import mixprec`; this pins that the decorator still
    does only that."""

    def f() -> int:
        return 1

    marked = torch.compiler.assume_constant_result(f)
    assert marked is f and f.__dict__ == {"_dynamo_marked_constant": True}


# ------------------------------------------------------------------ the differential harness
class Stack(nn.Module):
    """Blocks in an nn.ModuleList that is never called itself (as in most transformers)."""

    def __init__(self, d: int = 16, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for _ in range(n)
        )
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(torch.softmax(x, dim=-1))


MODELS: dict[str, Any] = {
    "mlp": (MLP, (8, 16)),
    "block": (lambda: Block(16), (2, 5, 16)),
    "cnn": (CNN, (4, 3, 8, 8)),
    "blocks": (Stack, (8, 16)),
}
POLICIES: dict[str, dict[str, str]] = {
    "class": {
        "mlp": "nn.LayerNorm=fp32, nn.GELU=fp16",
        "block": "nn.LayerNorm=fp32, nn.GELU=fp16",
        "cnn": "nn.Conv2d=fp32, nn.AdaptiveAvgPool2d=fp16",
        "blocks": "nn.LayerNorm=fp32, nn.GELU=fp16",
    },
    "name": {
        "mlp": "fc2=fp32, fc1=fp16",
        "block": "attn=fp32, mlp.2=fp16",
        "cnn": "conv=fp32, head=fp16@fp32",
        "blocks": "layers.1=fp16, head=fp32, layers.0.1=fp32@input",
    },
    "op": {
        "mlp": "F.gelu=fp32, F.layer_norm=low",
        "block": "F.softmax=fp32, F.gelu=fp32",
        "cnn": "torch.relu=fp32",
        "blocks": "F.softmax=fp32, F.layer_norm=fp32",
    },
    "fp8": {
        "mlp": "nn.Linear=fp8:rowwise",
        "block": "nn.Linear=fp8",
        "cnn": "head=fp8:rowwise_gw_hp",
        "blocks": "layers=fp8",
    },
    "mixed": {
        "mlp": "nn.LayerNorm=fp32, fc1=fp8, F.gelu=fp32",
        "block": "nn.LayerNorm=fp32, mlp=fp8:rowwise, attn.proj=fp16, F.softmax=fp32",
        "cnn": "nn.BatchNorm2d=fp32, head=fp8, torch.relu=fp32",
        "blocks": "layers=fp8:rowwise, layers.0.1=fp32, F.softmax=fp32, nn.LayerNorm=fp32",
    },
}


def fresh(kind: str) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    factory, shape = MODELS[kind]
    torch.manual_seed(0)
    model = factory()
    return model, copy.deepcopy(model), torch.randn(*shape)


@pytest.mark.parametrize("kind", list(MODELS))
def test_harness_compiled_first_then_switched(kind: str) -> None:
    """Compiled first under the first policy, then switched through the others and back."""
    torch._dynamo.reset()
    model, twin, x = fresh(kind)
    compiled = torch.compile(model, backend="aot_eager")
    order = [*POLICIES, None, next(iter(POLICIES))]  # None: a region without a policy
    for name in order:
        if name == "fp8" and kind == "block":
            continue  # its mixed policy has an fp8 recipe; fp8 graphs are the slow compiles
        policy = None if name is None else POLICIES[name][kind]
        assert_bitwise(run(compiled, x, policy), run(twin, x, policy), f"{kind} {name}: {policy}")


@pytest.mark.parametrize("kind", list(MODELS))
def test_harness_eager_first_then_compiled(kind: str) -> None:
    """The same model run eagerly under a policy, then compiled under it and under another."""
    torch._dynamo.reset()
    model, twin, x = fresh(kind)
    compiled = torch.compile(model, backend="aot_eager")
    name = {"mlp": "mixed", "block": "name", "cnn": "mixed", "blocks": "fp8"}[kind]
    for _ in range(2):  # eager, compiled; then eager again, the cached graph
        policy = POLICIES[name][kind]
        eager = run(model, x, policy)
        assert_bitwise(eager, run(twin, x, policy), f"{kind} {name} (eager, twin)")
        assert_bitwise(run(compiled, x, policy), eager, f"{kind} {name} (compiled after eager)")


def test_harness_inductor_within_tolerance() -> None:
    """One inductor case (its kernels may round differently from eager): dtypes equal, values
    within a tolerance that bf16 rounding of a few elements cannot break."""
    torch._dynamo.reset()
    model, twin, x = fresh("mlp")
    compiled = torch.compile(model, backend="inductor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("mixed", "name", "mixed"):
            policy = POLICIES[name]["mlp"]
            got, want = run(compiled, x, policy), run(twin, x, policy)
            assert [t.dtype for t in got] == [t.dtype for t in want], name
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_rules_reach_the_blocks_of_a_container_under_compile() -> None:
    torch._dynamo.reset()
    model, twin, x = fresh("blocks")
    compiled = torch.compile(model, backend="aot_eager")
    got = run(compiled, x, "layers=fp32")
    assert_bitwise(got, run(twin, x, "layers=fp32"), "container rule")
    assert not torch.equal(got[0], run(twin, x, None)[0])  # the blocks ran in fp32


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), nn.GELU())
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=False))


@pytest.mark.parametrize(
    "policy",
    [
        "block.0=fp32, block.0.0=fp16, F.layer_norm=low",  # rules inside an fp32 island do nothing
        "nn.LayerNorm=fp32, F.gelu=fp32, head=fp16",
        "block=fp8:rowwise",
    ],
)
def test_checkpointed_blocks_of_a_compiled_model(policy: str) -> None:
    """Checkpoint inside the compiled model (a higher-order op Dynamo traces into a subgraph)."""
    torch._dynamo.reset()
    model = Checkpointed()
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 8)
    assert_bitwise(run(compiled, x, policy), run(twin, x, policy), policy)


@pytest.mark.parametrize("policy", ["nn.Linear=fp8", "0=nvfp4", "nn.Linear=bf16/mxfp8/nvfp4"])
def test_an_fp8_policy_compiles_once_over_many_regions(policy: str) -> None:
    """A region per step (as a training loop has it): one graph, not one per region (the
    compiled forward must not guard on what an earlier region recorded)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(64, 32)
    with graphs() as found:
        for _ in range(4):
            with mixprec.autocast("cpu", BF16, policy=policy):
                y = compiled(x)
            y.float().sum().backward()
    assert found["graphs"] == 1
