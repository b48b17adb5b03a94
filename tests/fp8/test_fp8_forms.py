"""The differential harness of #32 over the module forms the issue lists: each form x every
fp8-family rule x eager / checkpointed (reentrant, non-reentrant) / compiled x interleaved
policies, bitwise the oracle (the recipe's casts written out in tests/fp8_oracle.py, the form's
matmuls written by hand in its ``oracle``), or a ConfigError naming the module; never the region's
plain dtype. How a case runs: tests/fp8_harness.py. The adversarial variants beyond this list:
tests/fp8/test_fp8_variants.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tests.fp8_harness import (
    BF16,
    COMPILE_WARNING,
    HOWS,
    RULES,
    D,
    Linear,
    assert_not_plain,
    compile_once,
    interleaved,
    make_input,
    unique_graphs,
)
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import mixprec
from mixprec.errors import ConfigError


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


def _policy_for(form: str) -> Callable[[str], mixprec.Policy]:
    def policy(rule: str) -> mixprec.Policy:
        spec = FORMS[form][1](rule)
        if "Conv1D" in spec:  # a class outside torch.nn: the class itself
            return mixprec.Policy(modules={Conv1D: rule})
        return mixprec.Policy(spec)

    return policy


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_runs_each_recipe_as_its_oracle(form: str, how: str) -> None:
    for rule in RULES:
        interleaved(FORMS[form][0], _policy_for(form), rule, how)


@pytest.mark.parametrize("form", list(FORMS))
def test_the_oracle_is_not_the_plain_region(form: str) -> None:
    """The oracles differ from the region's plain dtype, so a rule doing nothing would fail."""
    assert_not_plain(FORMS[form][0])


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
        out = model(make_input(1))
    out.float().sum().backward()
    assert stats.names == ["body.a"]
    assert stats.read()["body.a"].grad_output.elements > 0


# ---------------------------------------------------------------- compiled
@pytest.mark.slow
@pytest.mark.filterwarnings(COMPILE_WARNING)
@pytest.mark.parametrize("form", list(FORMS))
def test_compiled_forms_run_recipes_as_their_oracle(form: str) -> None:
    """One compiled wrapper per form (aot_eager), two recipes through it (a policy switch): the
    form's place in FORMS picks the first, so every rule is the first of two forms at least."""
    rule = list(RULES)[list(FORMS).index(form) % len(RULES)]
    before = unique_graphs()
    interleaved(FORMS[form][0], _policy_for(form), rule, "eager", wrap=compile_once())
    assert unique_graphs() > before  # it did compile
