"""A module reachable under several names answers to each of them in a policy.

``nn.ModuleList([block] * 3)`` and a module assigned to two parents are one module object at
several places: a rule naming any of its names applies to it (differential: the same rule on an
untied copy where each place is its own module, and a glob matching every name); names that
take different rules, and parents that give a shared child different rules, are refused with
the names and the fix; the advisor's proposal on such a model runs.
"""

from __future__ import annotations

import copy

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn

import mixprec
from mixprec import Policy
from mixprec.errors import ConfigError

WIDTH = 32  # a multiple of every block recipe's block, so fp8 rules can serve the Linears


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln(x))


class Repeated(nn.Module):
    """One block three times (``nn.ModuleList([block] * 3)``), or three copies of it."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        block = Block()
        blocks = [block] * 3 if tied else [copy.deepcopy(block) for _ in range(3)]
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Wrap(nn.Module):
    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner
        self.own = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(torch.relu(self.inner(x)))


class TwoParents(nn.Module):
    """One Linear held by two parents (``a.inner`` and ``b.inner``), or a copy in each."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        inner = nn.Linear(WIDTH, WIDTH)
        self.a = Wrap(inner)
        self.b = Wrap(inner if tied else copy.deepcopy(inner))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class TiedHead(nn.Module):
    """A head that is the body's last Linear (``head`` and ``body.2``), or a copy of it."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
        self.head = self.body[2] if tied else copy.deepcopy(self.body[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


# model class, the names of the shared module, a glob naming each of them
SHARED = {
    "blocks": (Repeated, ["layers.0", "layers.1", "layers.2"], "layers.*"),
    "block children": (Repeated, ["layers.0.fc", "layers.1.fc", "layers.2.fc"], "layers.*.fc"),
    "two parents": (TwoParents, ["a.inner", "b.inner"], "*.inner"),
    "tied head": (TiedHead, ["body.2", "head"], "*[2d]"),
}
RULES = ["fp32", "bf16", "fp16", "fp32@low", "mxfp8", "nvfp4", "bf16/mxfp8/bf16"]


def _model(cls: type[nn.Module], tied: bool) -> nn.Module:
    torch.manual_seed(0)
    return cls(tied=tied)  # type: ignore[call-arg]


def _run(model: nn.Module, policy: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))
    with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
        out = model(x)
    out.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(sorted(SHARED)), index=st.integers(0, 2), rule=st.sampled_from(RULES))
def test_a_rule_naming_any_name_of_a_module_applies_to_it(kind: str, index: int, rule: str) -> None:
    cls, names, glob = SHARED[kind]
    name = names[index % len(names)]
    out, grads = _run(_model(cls, tied=True), f"{name}={rule}")
    every, every_grads = _run(_model(cls, tied=True), f"{glob}={rule}")
    untied = ", ".join(f"{n}={rule}" for n in names)
    out_untied, _ = _run(_model(cls, tied=False), untied)
    assert torch.equal(out, every) and torch.equal(out, out_untied)
    assert grads.keys() == every_grads.keys()
    assert all(torch.equal(grads[k], every_grads[k]) for k in grads)


@pytest.mark.parametrize("kind", sorted(SHARED))
def test_resolve_names_the_module_by_its_first_name_whichever_name_the_rule_uses(kind: str) -> None:
    cls, names, _ = SHARED[kind]
    model = _model(cls, tied=True)
    first = dict(model.named_modules())  # torch's own names: the first of each module
    assert names[0] in first and not any(n in first for n in names[1:])
    for name in names:
        assert Policy(f"{name}=fp32").resolve(model) == {names[0]: mixprec.Rule("fp32")}


@pytest.mark.parametrize("kind", sorted(SHARED))
def test_names_of_one_module_that_take_different_rules_are_refused(kind: str) -> None:
    cls, names, glob = SHARED[kind]
    model = _model(cls, tied=True)
    clash = f"{names[0]}=fp32, {names[-1]}=bf16"
    region = mixprec.autocast("cpu", policy=clash)
    with pytest.raises(ConfigError, match="different rules") as info, region:
        model(torch.randn(2, WIDTH))
    assert repr(names[0]) in str(info.value) and repr(names[-1]) in str(info.value)
    assert not torch.is_autocast_enabled("cpu")  # the region left nothing behind
    _run(model, f"{names[0]}=fp32")  # and the model runs under a policy that agrees
    with pytest.raises(ConfigError, match="different rules"):
        Policy(clash).resolve(model)
    # the same rule under two names, or a glob before an exact name (the first match per name)
    same = f"{names[0]}=fp32, {glob}=fp32, {names[-1]}=bf16"
    assert Policy(same).resolve(model)[names[0]] == mixprec.Rule("fp32")


def test_parents_that_give_a_shared_child_different_rules_are_refused() -> None:
    model = _model(TwoParents, tied=True)
    x = torch.randn(2, WIDTH)
    region = mixprec.autocast("cpu", policy="a=fp32, b=fp16")
    with pytest.raises(ConfigError, match="parents give it different rules") as info, region:
        model(x)
    assert "'a.inner', 'b.inner'" in str(info.value) and "'a.inner=<rule>'" in str(info.value)
    # its own rule, by either name, settles it; one parent alone reaches it at both places
    for fix in ("a=fp32, b=fp16, b.inner=fp32", "a=fp32, b=fp16, a.inner=fp32", "a=fp32"):
        with mixprec.autocast("cpu", policy=fix):
            model(x)


def test_a_rule_by_a_later_name_reaches_its_subtree() -> None:
    """``layers.2=fp32`` rules the block's children at every place (they inherit from the
    block, whichever of its names the rule used), as ``layers.0=fp32`` does."""
    outs = [_run(_model(Repeated, True), f"layers.{i}=fp32")[0] for i in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs)
    plain, _ = _run(_model(Repeated, True), "head=bf16")
    assert not torch.equal(outs[0], plain)  # the rule did something


def test_advise_on_a_repeated_block_proposes_a_policy_that_runs() -> None:
    model = _model(Repeated, tied=True)
    x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(2))

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return m(batch).float().pow(2).mean()

    advice = mixprec.advise(
        model, x, loss_fn, candidates=["mxfp8"], modules=["layers.0.fc"], min_sqnr=10.0, check=True
    )
    policy = advice.policy
    assert "layers.0.fc" in policy.name_rules  # torch's first name: the case that crashed
    assert Policy(str(policy)) == policy
    with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
        out = model(x)
    assert out.isfinite().all()
