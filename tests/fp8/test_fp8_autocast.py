"""What an fp8-family rule does at the edges of the autocast side (#24 item 6): a class rule
that serves nothing, nn.MultiheadAttention, tied weights, a parametrized Linear; eager,
torch.compile and activation checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.checkpoint import checkpoint

import mixprec
from mixprec._src.fp8.matmul import Plan, fp8_linear
from mixprec._src.fp8.recipes import get_recipe
from mixprec.errors import ConfigError

BF16 = torch.bfloat16
COMPILE_WARNING = "ignore:Using `torch.compile\\(module\\)` when there are global hooks"


def region(policy: str) -> mixprec.autocast:
    return mixprec.autocast("cpu", BF16, policy=policy)


# ---------------------------------------------------------------- a class rule serving nothing
def test_a_class_rule_that_serves_no_module_in_the_region_is_refused() -> None:
    """'nn.Linear=fp8' on a model without a Linear ran with no word (name rules already
    raised)."""
    convnet = nn.Sequential(nn.Conv1d(4, 4, 1), nn.ReLU())
    refused = pytest.raises(ConfigError, match=r"nn\.Linear=mxfp8 served no module in this region")
    with refused, region("nn.Linear=mxfp8"):
        convnet(torch.randn(2, 4, 3))
    relaxed = mixprec.Policy("nn.Linear=mxfp8", strict=False)
    with mixprec.autocast("cpu", BF16, policy=relaxed):
        convnet(torch.randn(2, 4, 3))
    with mixprec.autocast("cpu", BF16, policy="nn.Linear=fp8", enabled=False):
        convnet(torch.randn(2, 4, 3))  # a region switched off applies no rule: nothing claimed


def test_a_class_rule_counts_the_modules_of_every_model_run_in_the_region() -> None:
    """The convnet alone is refused (above); beside an MLP in the same region the rule served
    the MLP's Linear, so the region exits without a word."""
    convnet, mlp = nn.Sequential(nn.Conv1d(4, 4, 1)), nn.Sequential(nn.Linear(4, 4))
    stats = mixprec.Fp8Stats()
    with stats, region("nn.Linear=fp8"):
        convnet(torch.randn(2, 4, 3))
        mlp(torch.randn(2, 4))
    assert stats.names == ["0"] and stats.read()["0"].input.elements == 2 * 4


@pytest.mark.slow
@pytest.mark.filterwarnings(COMPILE_WARNING)
def test_a_class_rule_serving_nothing_is_refused_under_compile() -> None:
    convnet = nn.Sequential(nn.Conv1d(4, 4, 1), nn.ReLU())
    compiled = torch.compile(convnet, backend="aot_eager")
    refused = pytest.raises(ConfigError, match="served no module in this region")
    with refused, region("nn.Linear=fp8"):
        compiled(torch.randn(2, 4, 3))


# ---------------------------------------------------------------- nn.MultiheadAttention
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.attn(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("policy", ["attn=fp8", "nn.Linear=fp8", "attn=nvfp4", "attn.out_proj=fp8"])
def test_a_rule_reaching_multihead_attention_is_refused_naming_it(policy: str) -> None:
    """Its projections run inside F.multi_head_attention_forward, which no rule can serve:
    'attn=fp8' passed the reach check (it found attn.out_proj) and ran plain bf16."""
    refused = pytest.raises(ConfigError, match=r"nn\.MultiheadAttention 'attn'.*'attn=bf16'")
    with refused, region(policy):
        Block()(torch.randn(2, 5, 64))


@pytest.mark.parametrize("fix", ["attn=bf16", "nn.MultiheadAttention=bf16"])
def test_the_attention_module_with_a_rule_of_its_own_runs_the_rest_in_fp8(fix: str) -> None:
    block, x = Block(), torch.randn(2, 5, 64)
    stats = mixprec.Fp8Stats()
    with stats, region(f"nn.Linear=fp8, {fix}"):
        out = block(x)
    assert stats.names == ["fc"]  # the attention in bf16, its output into an fp8 Linear
    with region("attn=bf16"):
        plain = block(x)
    assert not torch.equal(out, plain)


@pytest.mark.slow
@pytest.mark.filterwarnings(COMPILE_WARNING)
def test_multihead_attention_is_refused_under_compile() -> None:
    compiled = torch.compile(Block(), backend="aot_eager")
    refused = pytest.raises(ConfigError, match=r"nn\.MultiheadAttention 'attn'")
    with refused, region("nn.Linear=fp8"):
        compiled(torch.randn(2, 5, 64))


# ---------------------------------------------------------------- tied weights
class TiedLM(nn.Module):
    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, 64, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.body(self.wte(idx))))


def test_tied_weights_the_head_runs_the_recipe_the_embedding_reads_the_weight() -> None:
    """An embedding and the head sharing one Parameter (nanoGPT): under 'nn.Linear=fp8' the
    head's three matmuls run the recipe on the shared weight, the embedding looks up its exact
    float32 rows, and the shared weight's gradient is the sum of both uses' gradients."""
    idx = torch.randint(0, 64, (4, 8))
    tied, untied = TiedLM(), TiedLM(tied=False)
    untied.load_state_dict(tied.state_dict())
    untied.lm_head.weight.data.copy_(tied.wte.weight.data)
    stats = mixprec.Fp8Stats()
    outs = []
    for model in (tied, untied):
        with stats, region("nn.Linear=fp8:rowwise"):
            out = model(idx)
        out.float().square().mean().backward()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    # two models in one Fp8Stats: separate records, labelled by model (#32 item 4)
    assert sorted(stats.names) == sorted(
        f"{label}/{name}" for label in ("TiedLM", "TiedLM#1") for name in ("body", "lm_head")
    )
    looked_up = []
    handle = tied.wte.register_forward_hook(lambda mod, args, out: looked_up.append(out))
    with region("nn.Linear=fp8:rowwise"):
        tied(idx)
    handle.remove()
    assert torch.equal(looked_up[0], tied.wte.weight[idx])  # the lookup: exact float32 rows
    shared = untied.wte.weight.grad + untied.lm_head.weight.grad
    assert torch.equal(tied.wte.weight.grad, shared)


# ---------------------------------------------------------------- a parametrized Linear
def _parametrized() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(weight_norm(nn.Linear(64, 64)), nn.GELU(), nn.Linear(64, 32))


def _step(model: nn.Module, x: torch.Tensor, wrap: bool = False) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with region("nn.Linear=fp8"):
        out = checkpoint(model, x, use_reentrant=False) if wrap else model(x)
    out.float().square().mean().backward()
    return [out, *(p.grad for p in model.parameters())]


def test_a_parametrized_linear_is_served() -> None:
    """weight_norm recomputes the weight at each access, so the identity match missed it: it ran
    plain bf16 under an fp8 rule and Fp8Stats listed it with 0 elements cast."""
    model, x = _parametrized(), torch.randn(16, 64)
    stats = mixprec.Fp8Stats()
    with stats, region("nn.Linear=fp8"):
        out = model(x)
    assert stats.read()["0"].input.elements == x.numel()
    weight = model[0].weight.detach()  # what the parametrization computes
    plan = Plan(get_recipe("tensorwise"), BF16, scaled_mm=False)
    first = fp8_linear(x, weight, model[0].bias, plan)
    want = fp8_linear(torch.nn.functional.gelu(first), model[2].weight, model[2].bias, plan)
    assert torch.equal(out, want)
    out.float().sum().backward()
    assert model[0].parametrizations.weight.original0.grad is not None


def test_a_parametrized_linear_is_served_under_activation_checkpointing() -> None:
    model, x = _parametrized(), torch.randn(16, 64)
    eager = _step(model, x)
    assert all(torch.equal(a, b) for a, b in zip(_step(model, x, wrap=True), eager, strict=True))


@pytest.mark.slow
@pytest.mark.filterwarnings(COMPILE_WARNING)
def test_a_parametrized_linear_is_served_under_compile() -> None:
    torch._dynamo.reset()
    model, x = _parametrized(), torch.randn(16, 64)
    eager = _step(model, x)
    compiled = torch.compile(copy.deepcopy(model), backend="aot_eager")
    for _ in range(2):
        got = _step(compiled, x)
        assert all(torch.equal(a, b) for a, b in zip(got, eager, strict=True))
