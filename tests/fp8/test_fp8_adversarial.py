"""#36 item 3, adversarial forms (helper adv1): the differential harness of #32 (bitwise the oracle
of tests/fp8_oracle.py) over forms the spelling and variant tests do not hold:

- ``F.linear`` names its weight: a module's input made of weights or constants (a Perceiver's
  learned latents through a child Linear, a fixed positional table or ``torch.ones`` projected)
  is that module's activation, served, whether or not the module's parent opened a scope (before:
  a ruled parent made the Linear's input "a weight" and the Linear refused, "served nothing");
- a guarded module whose only matmul computes a weight names that matmul in its error (before:
  "called no torch function on its weights").
"""

from __future__ import annotations

import pytest
import torch
from tests.fp8_harness import HOWS, RULES, D, Linear, assert_not_plain, interleaved
from torch import nn

import mixprec
from mixprec.errors import ConfigError


class Latents(nn.Module):
    """A learned latent array through a child Linear (a Perceiver's queries)."""

    def __init__(self) -> None:
        super().__init__()
        self.lat = nn.Parameter(torch.randn(4, D))
        self.q = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.q(self.lat)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return x + lin(self.lat, self.q.weight, self.q.bias)


def _table() -> torch.Tensor:
    pos, i = torch.arange(4.0)[:, None], torch.arange(D)[None]
    return torch.sin(pos / 10000 ** (i / D))


class Table(nn.Module):
    """A fixed positional table (made from no tensor) projected by a child Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p(_table())

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return x + lin(_table(), self.p.weight, self.p.bias)


class Ones(nn.Module):
    """A Linear on ``torch.ones`` (an initial state) and on the input, in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.p(x) * self.p(torch.ones(x.shape))

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        w, b = self.p.weight, self.p.bias
        return lin(x, w, b) * lin(torch.ones(x.shape), w, b)


class Holder(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.m = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(x)  # type: ignore[no-any-return]

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return self.m.oracle(x, lin)  # type: ignore[operator]


FORMS = {"latents": Latents, "table": Table, "ones": Ones}
# The rule on the parent (its scope open around the Linear's input), on the class, everywhere.
POLICIES = {"parent": "m={r}", "class": "nn.Linear={r}", "everything": "*={r}"}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("where", POLICIES)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("how", [HOWS[0], HOWS[1]])
def test_a_linear_serves_its_input_whatever_made_it(form: str, where: str, rule: str, how: str):
    def make() -> nn.Module:
        return Holder(FORMS[form]())

    interleaved(make, lambda r: POLICIES[where].format(r=r), rule, how)


@pytest.mark.parametrize("form", FORMS)
def test_the_forms_are_not_the_plain_dtype(form: str) -> None:
    assert_not_plain(lambda: Holder(FORMS[form]()))


class ConstantTimesWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.ones(4, D) @ self.w


def test_a_guarded_module_computing_only_a_weight_names_that_matmul() -> None:
    model = Holder(ConstantTimesWeight())
    region = mixprec.autocast("cpu", torch.bfloat16, policy="m=fp8")
    with pytest.raises(ConfigError, match=r"module 'm'.*Tensor\.matmul computing a weight"), region:
        model(torch.randn(2, 4, D))
