"""The differential harness of #32: module forms x fp8-family rules x eager / checkpointed
(reentrant, non-reentrant) / compiled x interleaved policies.

Each case runs a form under a policy whose rule reaches it, bitwise against the oracle: the same
computation written with the recipe's own function (``fp8_linear`` and a ``Plan``, called here,
not through autocast) on the weight as the form computes it, or a ConfigError naming the module;
never the region's plain dtype (the forms' oracles differ from plain bf16, checked once per form).

Interleaving: each case runs two forwards of the same model under two policies (the case's rule,
then the next rule of the list), then the first backward, then the second, each compared with its
oracle (reentrant checkpointing recomputes in the first backward: the first forward's rule must
come back, not the latest). ``torch.compile`` (aot_eager) runs a representative subset (four forms,
two recipes each), compiled once per form.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.checkpoint import checkpoint

import mixprec
from mixprec._src.fp8.matmul import Plan, fp8_linear
from mixprec._src.fp8.recipes import get_recipe
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
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


# ---------------------------------------------------------------- the forms
class Transposed(nn.Linear):
    """loralib's fan_in_fan_out: the weight stored (in, out), transposed in forward."""

    def __init__(self, d: int) -> None:
        super().__init__(d, d)
        self.weight = nn.Parameter(self.weight.detach().t().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.transpose(0, 1), self.bias)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return lin(x, self.weight.transpose(0, 1), self.bias)


class Scaled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * 0.5, self.bias)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return lin(x, self.weight * 0.5, self.bias)


class LoraMerged(nn.Linear):
    def __init__(self, d: int, r: int = 4) -> None:
        super().__init__(d, d)
        self.lora_a = nn.Parameter(torch.randn(r, d) / d)
        self.lora_b = nn.Parameter(torch.randn(d, r) / r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight + (self.lora_b @ self.lora_a) * 2.0, self.bias)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return lin(x, self.weight + (self.lora_b @ self.lora_a) * 2.0, self.bias)


class MatmulT(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return lin(x, self.weight, None) + self.bias


class Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D: weight (in, out), ``addmm``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.bias = nn.Parameter(torch.randn(d) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], -1)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return lin(x.view(-1, x.size(-1)), self.weight.t(), self.bias).view(*x.shape[:-1], -1)


class Plain(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return lin(x, self.fc.weight, self.fc.bias)


class WeightNormed(Plain):
    def __init__(self, d: int) -> None:
        super().__init__(d)
        self.fc = weight_norm(nn.Linear(d, d))


class Iterated(nn.Module):
    """A parent iterating an nn.Sequential (timm's checkpoint_seq) or an nn.ModuleList, one
    layer indexed and the rest sliced."""

    def __init__(self, d: int, container: type[nn.Module]) -> None:
        super().__init__()
        layers = [nn.Linear(d, d) for _ in range(3)]
        self.layers = (
            nn.ModuleList(layers) if container is nn.ModuleList else nn.Sequential(*layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        for layer in self.layers[1:]:
            x = torch.relu(layer(x))
        return x

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        x = lin(x, self.layers[0].weight, self.layers[0].bias)
        for layer in list(self.layers)[1:]:
            x = torch.relu(lin(x, layer.weight, layer.bias))
        return x


class Sliced(Iterated):
    """A parent calling a slice of an nn.Sequential (a new container of the same modules)."""

    def __init__(self, d: int) -> None:
        super().__init__(d, nn.Sequential)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1:](self.layers[0](x))

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        for layer in self.layers:
            x = lin(x, layer.weight, layer.bias)
        return x


class Body(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.b.weight = self.a.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Tied(nn.Module):
    """``body=<rule>, body.b=bf16`` with ``body.b``'s weight tied to ``body.a``'s."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.body = Body(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        a, b = self.body.a, self.body.b
        return F.linear(torch.relu(lin(x, a.weight, a.bias)), b.weight, b.bias)  # b: plain bf16


class Nested(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.outer = nn.Sequential(
            nn.Sequential(nn.Linear(d, d)), nn.ReLU(), nn.Sequential(nn.Sequential(nn.Linear(d, d)))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(x)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        first, second = self.outer[0][0], self.outer[2][0][0]
        return lin(torch.relu(lin(x, first.weight, first.bias)), second.weight, second.bias)


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


# form -> (factory, the policy for a rule)
FORMS: dict[str, tuple[Callable[[], nn.Module], Callable[[str], str]]] = {
    "linear": (lambda: Plain(D), lambda r: f"fc={r}"),
    "linear-class-rule": (lambda: Plain(D), lambda r: f"nn.Linear={r}"),
    "transposed": (lambda: Transposed(D), lambda r: f"nn.Linear={r}"),
    "scaled": (lambda: Scaled(D, D), lambda r: f"nn.Linear={r}"),
    "lora-merged": (lambda: LoraMerged(D), lambda r: f"nn.Linear={r}"),
    "x@W.t()": (lambda: MatmulT(D, D), lambda r: f"nn.Linear={r}"),
    "weight-norm": (lambda: WeightNormed(D), lambda r: f"fc={r}"),
    "conv1d-addmm": (lambda: Conv1D(D), lambda r: f"{Conv1D.__module__}.Conv1D={r}"),
    "iterated-sequential": (lambda: Iterated(D, nn.Sequential), lambda r: f"layers={r}"),
    "modulelist": (lambda: Iterated(D, nn.ModuleList), lambda r: f"layers={r}"),
    "sliced-sequential": (lambda: Sliced(D), lambda r: f"layers={r}"),
    "tied-exception": (lambda: Tied(D), lambda r: f"body={r}, body.b=bf16"),
    "nested": (lambda: Nested(D), lambda r: f"outer={r}"),
}


def _policy(form: str, rule: str) -> mixprec.Policy:
    spec = FORMS[form][1](rule)
    if "Conv1D" in spec:  # a class outside torch.nn: the class itself
        return mixprec.Policy(modules={Conv1D: rule})
    return mixprec.Policy(spec)


# ---------------------------------------------------------------- running a case
def _run(model: nn.Module, x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "eager":
        return model(x)
    return checkpoint(model, x, use_reentrant=how == "reentrant")


def _grads(model: nn.Module, x: torch.Tensor, out: torch.Tensor, seed: int) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)  # nvfp4 rounds gradients stochastically: the same draws
    out.float().square().mean().backward()
    assert x.grad is not None
    grads = [out.detach(), x.grad]
    return grads + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _oracle(model: nn.Module, x: torch.Tensor, recipe: str, seed: int) -> list[torch.Tensor]:
    plan = Plan(get_recipe(recipe), BF16, scaled_mm=False)

    def lin(inp: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(inp, w, b, plan)

    with torch.autocast("cpu", BF16, cache_enabled=False):
        out = model.oracle(x, lin)  # type: ignore[operator]
    return _grads(model, x, out, seed)


def _input(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(2, 4, D).requires_grad_()


def _assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype, f"{what}: tensor {i} is {a.dtype}, the oracle gives {b.dtype}"
        assert torch.equal(a, b), f"{what}: tensor {i} differs from the oracle"


def _interleaved(form: str, rule: str, how: str, model: Any = None) -> None:
    """Forward under ``rule``, forward under the next rule, backward of each, vs the oracles."""
    torch.manual_seed(0)
    base = FORMS[form][0]()
    model = base if model is None else model(base)
    rules = list(RULES)
    second = rules[(rules.index(rule) + 1) % len(rules)]
    x1, x2 = _input(1), _input(2)
    outs = []
    for r, x in ((rule, x1), (second, x2)):
        with mixprec.autocast("cpu", BF16, policy=_policy(form, r)):
            outs.append(_run(model, x, how))
    got1 = _grads(base, x1, outs[0], 11)
    got2 = _grads(base, x2, outs[1], 12)
    want1 = _oracle(base, _input(1), RULES[rule], 11)
    want2 = _oracle(base, _input(2), RULES[second], 12)
    _assert_bitwise(got1, want1, f"{form} under {rule} ({how}, interleaved with {second})")
    _assert_bitwise(got2, want2, f"{form} under {second} ({how}, after {rule})")


@pytest.mark.parametrize("how", ["eager", "reentrant", "non-reentrant"])
@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_runs_each_recipe_as_its_oracle(form: str, how: str) -> None:
    for rule in RULES:
        _interleaved(form, rule, how)


@pytest.mark.parametrize("form", list(FORMS))
def test_the_oracle_is_not_the_plain_region(form: str) -> None:
    """The oracles differ from the region's plain dtype, so a rule doing nothing would fail."""
    torch.manual_seed(0)
    model = FORMS[form][0]()
    plain = copy.deepcopy(model)
    with torch.autocast("cpu", BF16, cache_enabled=False):
        want = plain(_input(1))
    got = _oracle(model, _input(1), "tensorwise", 0)[0]
    assert not torch.equal(got, want.detach())


@pytest.mark.parametrize("rule", list(RULES))
def test_attention_is_refused_naming_the_module(rule: str) -> None:
    model = Attention(D)
    for spec in (f"attn={rule}", f"nn.Linear={rule}, attn.out_proj={rule}", f"*={rule}"):
        refused = pytest.raises(ConfigError, match="MultiheadAttention 'attn'")
        with refused, mixprec.autocast("cpu", BF16, policy=spec):
            model(torch.randn(2, 4, D))


def test_a_ruled_module_that_serves_nothing_is_refused_at_its_forward() -> None:
    class Einsum(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.einsum("bi,oi->bo", x, self.weight)

    class Lookup(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight.sum()

    net = nn.Sequential(Einsum(D, D))
    refused = pytest.raises(ConfigError, match=r"module '0'.*torch\.einsum")
    with refused, mixprec.autocast("cpu", BF16, policy="nn.Linear=fp8"):
        net(torch.randn(2, D))
    net = nn.Sequential(Lookup(D, D))
    refused = pytest.raises(ConfigError, match=r"module '0' \(Lookup\).*issued no matmul")
    with refused, mixprec.autocast("cpu", BF16, policy="0=mxfp8"):
        net(torch.randn(2, D))


def test_the_tied_weight_is_recorded_under_the_module_that_calls_it() -> None:
    model = Tied(D)
    stats = mixprec.Fp8Stats()
    with stats, mixprec.autocast("cpu", BF16, policy="body=mxfp8, body.b=bf16"):
        out = model(_input(1))
    out.float().sum().backward()
    assert stats.names == ["body.a"]
    assert stats.read()["body.a"].grad_output.elements > 0


# ---------------------------------------------------------------- compiled
COMPILED = {
    "linear": "fp8",
    "x@W.t()": "mxfp8",
    "conv1d-addmm": "fp8:rowwise",
    "tied-exception": "nvfp4",
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global")
@pytest.mark.parametrize("form", list(COMPILED))
def test_compiled_forms_run_each_recipe_as_their_oracle(form: str) -> None:
    """One compiled wrapper per form, two recipes through it (a policy switch), aot_eager."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled: dict[str, Any] = {}

    def compile_once(model: nn.Module) -> Any:
        if "fn" not in compiled:
            compiled["fn"] = torch.compile(model, backend="aot_eager")
        return compiled["fn"]

    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    _interleaved(form, COMPILED[form], "eager", model=compile_once)
    assert counters["stats"]["unique_graphs"] > before  # it did compile
