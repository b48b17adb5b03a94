"""#36 item 3, adversarial forms (helper adv1): the differential harness of #32 (bitwise the oracle
of tests/fp8_oracle.py) over forms the spelling and variant tests do not hold:

- ``F.linear`` names its weight: a module's input made of weights or constants (a Perceiver's
  learned latents through a child Linear, a fixed positional table or ``torch.ones`` projected)
  is that module's activation, served, whether or not the module's parent opened a scope (before:
  a ruled parent made the Linear's input "a weight" and the Linear refused, "served nothing");
- a guarded module whose only matmul computes a weight names that matmul in its error (before:
  "called no torch function on its weights");
- ``F.linear(W, x)`` (``W @ x.T``: the weight as F.linear's input) is served as ``torch.mm(W,
  x.t())`` is (before: refused as "F.linear on one of its weights"), and a weight of another rank
  is refused naming the op the forward ran (before: "a matmul");
- a constant made in a block (a causal mask) is freed with the block, not kept by the mode until
  the outermost ruled forward ends;
- the gather's missing-copy error names the casts of the weight's recipe (was "a rowwise weight",
  also for mxfp8).
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
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
        return self.m(x)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return self.m.oracle(x, lin)  # type: ignore[operator]


FORMS = {"latents": Latents, "table": Table, "ones": Ones}
# The rule on the parent (its scope open around the Linear's input), on the class, everywhere.
POLICIES = {"parent": "m={r}", "class": "nn.Linear={r}", "everything": "*={r}"}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("where", POLICIES)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("how", [HOWS[0], HOWS[1]])
def test_a_linear_serves_its_input_whatever_made_it(
    form: str, where: str, rule: str, how: str
) -> None:
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


# ---------------------------------------------------------------- F.linear with the weight first
def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, D)


WEIGHT_FIRST = {
    # F.linear(W, x) is W @ x.T: the weight consumed as the left operand, as torch.mm(W, x.t())
    "F.linear(W,x).t()": (
        lambda x, w, b: F.linear(w, _rows(x)).t() + b,
        lambda x, w, b, lin: lin(_rows(x), w, None) + b,
    ),
    "F.linear(input=W,weight=x,bias=).t()": (
        lambda x, w, b: F.linear(input=w, weight=_rows(x), bias=b[:1]).t(),
        lambda x, w, b, lin: lin(_rows(x), w, None) + b[:1].to(torch.bfloat16)[:, None],
    ),
    "F.linear(W,row)": (
        lambda x, w, b: torch.stack([F.linear(w, r) for r in _rows(x)]) + b,
        lambda x, w, b, lin: torch.stack([lin(r, w, None) for r in _rows(x)]) + b,
    ),
}


class WeightFirst(nn.Linear):
    def __init__(self, spelling: str) -> None:
        super().__init__(D, D)
        self.run, self.want = WEIGHT_FIRST[spelling]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, self.weight, self.bias).view(*x.shape[:-1], -1)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        out = self.want(x, self.weight, self.bias, lin)
        return out.view(*x.shape[:-1], -1)


@pytest.mark.parametrize("spelling", WEIGHT_FIRST)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("how", [HOWS[0], HOWS[2]])
def test_f_linear_with_the_weight_as_its_input_is_served(
    spelling: str, rule: str, how: str
) -> None:
    interleaved(lambda: Holder(WeightFirst(spelling)), lambda r: f"m={r}", rule, how)


class NdWeight(nn.Linear):
    def __init__(self, op: str) -> None:
        super().__init__(D, D)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.unsqueeze(0)
        return F.linear(x, w) if self.op == "F.linear" else torch.matmul(x, w.mT)


@pytest.mark.parametrize("op", ["F.linear", "torch.matmul"])
def test_a_weight_of_another_rank_is_refused_naming_the_op(op: str) -> None:
    region = mixprec.autocast("cpu", torch.bfloat16, policy="m=fp8")
    match = rf"module 'm'.*runs {op} on a 3-D weight"
    with pytest.raises(ConfigError, match=match), region:
        Holder(NdWeight(op))(torch.randn(2, 4, D))


# ---------------------------------------------------------------- what the mode keeps alive
class MaskBlock(nn.Module):
    """A block that makes a constant (a causal mask) in its forward and uses it."""

    def __init__(self, seen: list[weakref.ref[torch.Tensor]]) -> None:
        super().__init__()
        self.fc, self.seen = nn.Linear(D, D), seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[-2], x.shape[-2]).tril()
        self.seen.append(weakref.ref(mask))
        return self.fc(mask @ x)


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[weakref.ref[torch.Tensor]] = []
        self.blocks = nn.ModuleList([MaskBlock(self.seen) for _ in range(4)])
        self.alive: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            self.alive.append(sum(r() is not None for r in self.seen))
        return x


@pytest.mark.parametrize("policy", ["blocks.*=fp8", "nn.Linear=fp8", "*=fp8"])
def test_a_constant_made_in_a_block_is_freed_with_it(policy: str) -> None:
    """The mode's constants are held weakly: a mask made in each block lives as long as it would
    without mixprec (under a rule on the root, before: every block's mask until the forward's
    end)."""
    model = Blocks()
    with torch.no_grad(), mixprec.autocast("cpu", torch.bfloat16, policy=policy):
        model(torch.randn(2, 64, D))
    assert model.alive == [0] * 4


# ---------------------------------------------------------------- the gather's messages
@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_a_missing_gathered_copy_names_the_recipes_casts(recipe: str) -> None:
    """The forward's copy only, asked for the input gradient's: the error names the casts of
    the weight's recipe (before: "a rowwise weight", also for mxfp8)."""
    from mixprec._src.fp8.carrier import Payload
    from mixprec._src.fp8.gather import orientations
    from mixprec._src.fp8.recipes import get_recipe

    casts = tuple(c for c, _ in orientations(get_recipe(recipe)))
    payload = Payload("fc", casts, lambda: torch.zeros(()), lambda: None)
    with pytest.raises(ConfigError, match=rf"Linear 'fc'.*{casts[1].short} along out_features"):
        payload.get(0, casts[1])
