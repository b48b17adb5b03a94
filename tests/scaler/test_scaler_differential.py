"""mixprec.GradScaler against torch.amp.GradScaler("cpu"): bit-identical runs.

Same model, data, optimizer and injected inf/NaN; the scale after every iteration, which steps ran,
and the final parameters and gradients must be equal bit for bit.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from tests.scaler_cases import Case, Trace, run

import mixprec

# Every test runs on the CPU's path and on the path a CUDA user takes (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("scaler_path")

SGD = functools.partial(torch.optim.SGD, lr=0.1)
OPTIMIZERS = {
    "sgd": SGD,
    "sgd-momentum-foreach": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, foreach=True),
    "sgd-momentum-fused": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, fused=True),
    "adam": functools.partial(torch.optim.Adam, lr=1e-2, foreach=False),
    "adam-foreach": functools.partial(torch.optim.Adam, lr=1e-2, foreach=True),
    "adam-fused": functools.partial(torch.optim.Adam, lr=1e-2, fused=True),
    "adamw-foreach": functools.partial(torch.optim.AdamW, lr=1e-2, foreach=True),
    "adamw-fused": functools.partial(torch.optim.AdamW, lr=1e-2, fused=True),
    "adagrad-fused": functools.partial(torch.optim.Adagrad, lr=1e-2, fused=True),
}
# Iteration 0 is left clean: torch's fused SGD with momentum corrupts its momentum buffer when
# its first step is skipped (a separate test shows mixprec does not).
INJECT = {2: math.inf, 5: math.nan}


def torch_scaler(**kwargs: float) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **kwargs)


def assert_same(a: Trace, b: Trace) -> None:
    assert a.scales == b.scales
    assert a.stepped == b.stepped
    assert len(a.params) == len(b.params)
    for x, y in zip(a.params + a.grads, b.params + b.grads, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_match_torch(name: str) -> None:
    case = Case(OPTIMIZERS[name], inject=INJECT)
    ours = run(case, mixprec.GradScaler)
    assert_same(run(case, torch_scaler), ours)
    assert ours.scales[2] < ours.scales[1]  # the injected inf backed off
    assert not ours.stepped[2] and not ours.stepped[5] and ours.stepped[3]


@pytest.mark.parametrize(
    "case",
    [
        Case(SGD, inject=INJECT, clip=0.5),
        Case(SGD, inject=INJECT, penalty=True),
        Case(SGD, inject={3: math.inf}, accumulate=2, iterations=10),
        Case(SGD, inject=INJECT, two_optimizers=True),
        Case(OPTIMIZERS["adam-fused"], inject=INJECT, two_optimizers=True, clip=0.5),
        Case(SGD, inject=INJECT, pickle_every_iteration=True),
        Case(OPTIMIZERS["adam-fused"], inject=INJECT, pickle_every_iteration=True),
        Case(SGD, init_scale=2.0**24, iterations=10),  # natural fp16 overflow at the start
        Case(SGD, inject=INJECT, autocast=False, growth_interval=1),
    ],
    ids=[
        "clip",
        "penalty",
        "accumulation",
        "two-optimizers",
        "fused-two-optimizers-clip",
        "pickle",
        "pickle-fused",
        "natural-overflow",
        "fp32-grow-every-step",
    ],
)
def test_scenarios_match_torch(case: Case) -> None:
    assert_same(run(case, torch_scaler), run(case, mixprec.GradScaler))


def test_device_forms_match_torch() -> None:
    case = Case(SGD, inject=INJECT)
    reference = run(case, torch_scaler)
    for factory in (
        functools.partial(mixprec.GradScaler, "cpu"),
        functools.partial(mixprec.GradScaler, "cuda"),  # no CUDA here: scales CPU tensors anyway
        functools.partial(mixprec.GradScaler, device=torch.device("cpu")),
    ):
        assert_same(reference, run(case, factory))


def test_seed_positional_form_matches_torch() -> None:
    case = Case(SGD, inject=INJECT)

    def seed_form(init_scale: float, growth_interval: int) -> mixprec.GradScaler:
        return mixprec.GradScaler(init_scale, 2.0, 0.5, growth_interval, True)

    assert_same(run(case, torch_scaler), run(case, seed_form))


def test_state_dicts_cross_load_both_ways() -> None:
    case = Case(SGD, inject=INJECT)
    ours, theirs = mixprec.GradScaler(init_scale=1024.0), torch_scaler(init_scale=1024.0)
    theirs.scale(torch.ones(()))
    theirs.update(4096.0)
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == 4096.0
    back = torch_scaler()
    back.load_state_dict(ours.state_dict())
    assert back.state_dict() == theirs.state_dict()
    assert case.iterations > 0
