"""Per-block compile, torchtitan's way (#36 item 4): each transformer block compiled by itself
(``block.compile(fullgraph=True)``, or ``torch.compile(block, fullgraph=True)``) under a policy.

Dynamo's recompile limit is 8 per code object, and every block runs the same code: a rule lookup
that Dynamo guards on the module's identity makes one graph per block and fails at the 9th. The
invariant: one graph per distinct rules of a block, not per block, each compiled block bitwise
the eager model (``aot_eager``), over 32 blocks, both compile styles, policies that give every
block the same rules and policies that give some blocks others (the expected count comes from
the policy's name globs, matched here with ``fnmatch``), and torchtitan's llama3 model built
through mixprec's converter.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from typing import Any

import pytest
import torch
import torch._dynamo
from tests.autocast_helpers import Block, assert_bitwise, graphs
from torch import nn

import mixprec

pytestmark = pytest.mark.slow
BF16 = torch.bfloat16
N = 32


class Small(nn.Module):
    """A block with one matmul: fp8 emulation traces slowly, one Linear per block is enough."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.norm(x))


class Stack(nn.Module):
    """torchtitan's shape: blocks in a ``ModuleDict`` named by their index, called in order."""

    def __init__(self, n: int = N, d: int = 16, block: type[nn.Module] = Block) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({str(i): block(d) for i in range(n)})
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return self.head(x)


def compile_blocks(model: Stack, style: str) -> None:
    if style == "in place":  # torchtitan's apply_compile
        for block in model.layers.values():
            block.compile(backend="aot_eager", fullgraph=True)
    else:
        for key, block in list(model.layers.items()):
            model.layers[key] = torch.compile(block, backend="aot_eager", fullgraph=True)


def step(model: nn.Module, x: torch.Tensor, policy: str) -> list[torch.Tensor]:
    """Forward under ``policy`` in a bf16 region, backward after it: output and gradients."""
    model.zero_grad(set_to_none=True)
    with mixprec.autocast("cpu", BF16, policy=policy):
        out = model(x)
    out.float().square().mean().backward()
    return [out.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]


def distinct_blocks(policy: str, model: Stack) -> int:
    """How many blocks differ in which of the policy's name globs match their modules (names as
    the region sees them, ``_orig_mod`` in a wrapped block; the class rules are the same in
    every block)."""
    globs = [r.split("=")[0].strip() for r in policy.split(",")]
    globs = [g for g in globs if not re.match(r"(nn|F)\.", g)]
    seen = set()
    for key, block in model.layers.items():
        names = [f"layers.{key}" + (f".{n}" if n else "") for n, _ in block.named_modules()]
        seen.add(
            frozenset((i, g) for i, n in enumerate(names) for g in globs if fnmatch.fnmatch(n, g))
        )
    return len(seen)


POLICIES = [
    "nn.LayerNorm=fp32",
    "nn.Linear=fp32",
    "nn.LayerNorm=fp32, layers.1*=fp32",
    "nn.GELU=fp32, layers.[0-3].mlp=fp16, layers.2?.attn.proj=fp32",
    "nn.Linear=fp8, layers.1*.lin=bf16",
]


CASES = [(p, "in place") for p in POLICIES] + [(POLICIES[2], "wrapped")]


@pytest.mark.parametrize(("policy", "style"), CASES)
def test_per_block_compile_makes_one_graph_per_distinct_rules(policy: str, style: str) -> None:
    torch._dynamo.reset()
    block = Small if "fp8" in policy else Block
    eager, compiled = Stack(block=block), Stack(block=block)
    compile_blocks(compiled, style)
    named = policy  # the same rules, by the names the compiled model's modules have
    if style == "wrapped":  # a wrapped block's modules are named under its _orig_mod
        named = re.sub(r"(layers\.[^.=]+)\.", r"\1._orig_mod.", policy)
    want_graphs = distinct_blocks(named, compiled)
    x = torch.randn(2, 3, 16, requires_grad=True)  # every block sees an input that needs grad
    want = step(eager, x, policy)
    with graphs() as made:
        got = step(compiled, x, named)
    assert made["graphs"] == want_graphs, (policy, style)
    assert_bitwise(got, want, f"{policy}, {style}")
    with graphs() as again:  # a second step reuses them all
        assert_bitwise(step(compiled, x, named), want, f"{policy}, {style}, again")
    assert again["graphs"] == 0


def test_a_policy_switch_recompiles_per_distinct_rules_not_per_block() -> None:
    """Two policies in turn: each distinct set of rules compiled once, later steps reuse it."""
    torch._dynamo.reset()
    eager, compiled = Stack(), Stack()
    compile_blocks(compiled, "in place")
    x = torch.randn(2, 3, 16, requires_grad=True)
    first, second = "nn.LayerNorm=fp32", "nn.LayerNorm=fp32, layers.3=fp32"
    made = []
    for policy in (first, second, first, second):
        want = step(eager, x, policy)
        with graphs() as new:
            assert_bitwise(step(compiled, x, policy), want, policy)
        made.append(new["graphs"])
    # second: only block 3's rules are new (the other 31 blocks reuse first's graph)
    assert made == [1, 1, 0, 0]


# ------------------------------------------------------------------ torchtitan's llama3
class CausalSDPA(nn.Module):
    """Causal attention on (batch, tokens, heads, dim): torchtitan's flex attention has no CPU
    backward (tests/torchtitan_worker.py uses the same stand-in)."""

    def forward(self, q: Any, k: Any, v: Any, *, scale: Any = None, **kwargs: Any) -> Any:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=kwargs.get("enable_gqa", False)
        )
        return out.transpose(1, 2)


def llama3(layers: int, policy: str) -> nn.Module:
    pytest.importorskip("torchtitan", reason="torchtitan is a test extra")
    from tests.torchtitan_trainer import stand_in_triton

    stand_in_triton()  # torchtitan 0.3 imports triton, absent from the CPU wheel
    from torchtitan.models.llama3 import model_registry

    from mixprec.integrations.torchtitan import MixprecConverter

    converter = MixprecConverter.Config(policy=policy, gather=False)
    config = model_registry("debugmodel", converters=[converter]).model
    config.layers = [copy.deepcopy(config.layers[0]) for _ in range(layers)]
    torch.manual_seed(0)
    model = config.build()
    model.init_weights(buffer_device=None)
    for block in model.layers.values():
        block.attention.inner_attention = CausalSDPA()
    return model


@pytest.mark.parametrize(
    "policy",  # fp8 on one Linear of each block: fp8 emulation traces slowly
    ["layers.*.feed_forward.w2=fp8:rowwise, lm_head=bf16", "nn.RMSNorm=fp32, lm_head=bf16"],
)
def test_torchtitan_llama3_compiled_per_block_under_the_converter(policy: str) -> None:
    """More blocks than the recompile limit, compiled as torchtitan's apply_compile does: one
    graph for all of them, the losses and gradients bitwise the eager model's."""
    torch._dynamo.reset()
    eager, compiled = llama3(9, policy), llama3(9, policy)
    for block in compiled.layers.values():  # torchtitan.distributed.compile.apply_compile
        block.compile(backend="aot_eager", fullgraph=True)
    tokens = torch.randint(0, 2048, (1, 9), generator=torch.Generator().manual_seed(0))

    def train_step(model: nn.Module) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])  # the converter's model enters the region itself
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return [loss.detach(), *(p.grad.clone() for p in model.parameters())]

    want = train_step(eager)
    with graphs() as made:
        got = train_step(compiled)
    assert made["graphs"] == 1
    assert_bitwise(got, want, policy)
