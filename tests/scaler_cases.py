"""A small training run that the differential tests execute with torch's and mixprec's scalers.

Each run returns what must be bit-identical between the two: the scale after every iteration,
which iterations stepped, and the final parameters and gradients.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Case:
    """What to do in a run. ``inject`` maps iteration -> value written into one grad."""

    optimizer: Callable[[Any], torch.optim.Optimizer]
    iterations: int = 8
    inject: dict[int, float] = field(default_factory=dict)
    clip: float | None = None
    penalty: bool = False
    accumulate: int = 1
    two_optimizers: bool = False
    pickle_every_iteration: bool = False
    init_scale: float = 2.0**16
    growth_interval: int = 2
    autocast: bool = True


@dataclass
class Trace:
    scales: list[float] = field(default_factory=list)
    stepped: list[bool] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)


def make_models(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return [copy.deepcopy(base) for _ in range(n)]


def data(iterations: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen))
        for _ in range(iterations)
    ]


def run(case: Case, make_scaler: Callable[..., Any]) -> Trace:
    """Train with ``make_scaler(init_scale=..., growth_interval=...)`` and record everything."""
    models = make_models(2 if case.two_optimizers else 1)
    optimizers = [case.optimizer(m.parameters()) for m in models]
    scaler = make_scaler(init_scale=case.init_scale, growth_interval=case.growth_interval)
    trace = Trace()
    for it, (x, y) in enumerate(data(case.iterations)):
        for model in models:
            loss = _loss(model, x, y, case)
            if case.penalty:
                loss = loss + _penalty(model, loss, scaler)
            scaler.scale(loss).backward()
        if it in case.inject:
            with torch.no_grad():
                models[-1][2].weight.grad[0, 0] = case.inject[it]
        if (it + 1) % case.accumulate:
            continue
        for opt in optimizers:
            params = [p for g in opt.param_groups for p in g["params"]]
            if case.clip is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, case.clip)
            before = [p.detach().clone() for p in params]
            scaler.step(opt)
            moved = any(not torch.equal(a, p) for a, p in zip(before, params, strict=True))
            trace.stepped.append(moved)
        scaler.update()
        trace.scales.append(scaler.get_scale())
        for opt in optimizers:
            opt.zero_grad(set_to_none=it % 2 == 0)
        if case.pickle_every_iteration:
            scaler = pickle.loads(pickle.dumps(scaler))
    for model in models:
        trace.params.extend(p.detach().clone() for p in model.parameters())
        trace.grads.extend(p.grad.clone() for p in model.parameters() if p.grad is not None)
    return trace


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, case: Case) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16, enabled=case.autocast):
        out = model(x)
    return torch.nn.functional.mse_loss(out.float(), y)


def _penalty(model: nn.Module, loss: torch.Tensor, scaler: Any) -> torch.Tensor:
    params = list(model.parameters())
    scaled = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
    inv = 1.0 / scaler.get_scale()
    grads = [g * inv for g in scaled]
    return sum(g.pow(2).sum() for g in grads).sqrt() * 0.1
