"""The demo's task: a small regression whose gradients are too small for fp16 without scaling.

The targets are smooth functions of the inputs, scaled down by :data:`TARGET_SCALE` (think of a
quantity measured in large units), and the loss is a mean over every output element of a batch.
Both make the per-element gradients of the network's outputs tiny: fine in float32, but below
the float16 range in the hidden layers, where they flush to zero unless the loss is scaled.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import mixprec

__all__ = ["RunResult", "RunSpec", "Task", "make_task", "train"]

D_IN, WIDTH, D_OUT = 32, 64, 64
N_TRAIN, N_TEST, BATCH = 8192, 2048, 512
TARGET_SCALE = 0.01
LR = 3e-3
#: Shorter than the default 2000 so that a few hundred steps show the scale growing.
GROWTH_INTERVAL = 15
#: How many times per run the low-precision gradients are compared with float32 ones.
PROBES = 30


@dataclass(frozen=True)
class RunSpec:
    """One of the three runs: its name, whether autocast is on, whether a scaler is used."""

    name: str
    autocast: bool
    scaled: bool


@dataclass
class RunResult:
    """What one run measured."""

    name: str
    dtype: str
    scaled: bool
    losses: list[float]
    test_loss: float
    r2: float
    flushed_fraction: float | None
    steps_skipped: int
    skipped_steps: list[int]
    scales: list[float]
    final_scale: float | None
    wall_s: float
    injected_inf_at: int | None = None


@dataclass(frozen=True)
class Task:
    """Data (train/test), the initial model, and the batch order shared by the three runs."""

    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    model: nn.Module
    batches: torch.Tensor  # (steps, BATCH) indices into x


def _target(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(D_IN, D_OUT, generator=gen) / math.sqrt(D_IN)
    return TARGET_SCALE * torch.sin(1.5 * x @ w)


def make_task(seed: int, steps: int, device: torch.device) -> Task:
    """Generate the data, the model and the batch order from ``seed`` (nothing is downloaded)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N_TRAIN + N_TEST, D_IN, generator=gen)
    y = _target(x, gen)
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(D_IN, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, D_OUT),
    )
    head = model[-1]
    assert isinstance(head, nn.Linear)
    with torch.no_grad():  # start with outputs of the targets' magnitude
        head.weight.mul_(TARGET_SCALE)
        head.bias.mul_(TARGET_SCALE)
    batches = torch.randint(0, N_TRAIN, (steps, BATCH), generator=gen)
    return Task(
        x[:N_TRAIN].to(device),
        y[:N_TRAIN].to(device),
        x[N_TRAIN:].to(device),
        y[N_TRAIN:].to(device),
        model.to(device),
        batches.to(device),
    )


def _probe_steps(steps: int) -> set[int]:
    return {round(i * (steps - 1) / max(PROBES - 1, 1)) for i in range(min(PROBES, steps))}


def _flushed(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """Compare the current (low-precision) grads with a float32 backward at the same point.

    Returns (elements that are zero in low precision but not in float32, non-zero fp32 elements).
    """
    low = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    ref_model = copy.deepcopy(model)
    ref_model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(ref_model(x), y).backward()
    ref = [p.grad for p in ref_model.parameters() if p.grad is not None]
    lost = sum(int(((lo == 0) & (r != 0)).sum()) for lo, r in zip(low, ref, strict=True))
    return lost, sum(int((r != 0).sum()) for r in ref)


def _r2(model: nn.Module, task: Task) -> tuple[float, float]:
    with torch.no_grad():
        err = float(nn.functional.mse_loss(model(task.x_test).float(), task.y_test))
    return err, 1.0 - err / float(task.y_test.var())


def _make_scaler(spec: RunSpec, device: torch.device, steps: int) -> mixprec.GradScaler | None:
    if not spec.scaled:
        return None
    return mixprec.GradScaler(device.type, growth_interval=GROWTH_INTERVAL, history=steps)


def train(
    task: Task,
    spec: RunSpec,
    dtype: torch.dtype,
    inject_inf: int | None = None,
    on_step: Callable[[], None] | None = None,
) -> RunResult:
    """Train a copy of ``task.model`` with Adam for ``len(task.batches)`` steps.

    ``inject_inf`` (scaled runs only) writes an inf into one gradient at that step, as an fp16
    overflow would, to show the skip and the backoff.
    """
    device = task.x.device
    model = copy.deepcopy(task.model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    scaler = _make_scaler(spec, device, len(task.batches))
    probes, lost, total, losses, probe_s = _probe_steps(len(task.batches)), 0, 0, [], 0.0
    start = time.perf_counter()
    for step, idx in enumerate(task.batches):
        xb, yb = task.x[idx], task.y[idx]
        opt.zero_grad(set_to_none=True)
        with mixprec.autocast(device.type, dtype=dtype, enabled=spec.autocast):
            loss = nn.functional.mse_loss(model(xb).float(), yb)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if spec.autocast and step in probes:
            t0 = time.perf_counter()
            a, b = _flushed(model, xb, yb)
            lost, total, probe_s = lost + a, total + b, probe_s + time.perf_counter() - t0
        if scaler is None:
            opt.step()
        else:
            if step == inject_inf:
                next(iter(model.parameters())).grad.view(-1)[0] = math.inf  # type: ignore[union-attr]
            scaler.step(opt)
            scaler.update()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step()
    wall = time.perf_counter() - start - probe_s
    test_loss, r2 = _r2(model, task)
    return _result(spec, dtype, losses, test_loss, r2, lost, total, scaler, wall, inject_inf)


def _result(
    spec: RunSpec,
    dtype: torch.dtype,
    losses: list[float],
    test_loss: float,
    r2: float,
    lost: int,
    total: int,
    scaler: mixprec.GradScaler | None,
    wall: float,
    inject_inf: int | None,
) -> RunResult:
    history = scaler.history() if scaler is not None else []
    return RunResult(
        name=spec.name,
        dtype=str(dtype).removeprefix("torch.") if spec.autocast else "float32",
        scaled=spec.scaled,
        losses=losses,
        test_loss=test_loss,
        r2=r2,
        flushed_fraction=lost / total if spec.autocast and total else None,
        steps_skipped=scaler.stats().steps_skipped if scaler is not None else 0,
        skipped_steps=[h.iteration - 1 for h in history if h.skipped],
        scales=[h.scale for h in history],
        final_scale=scaler.get_scale() if scaler is not None else None,
        wall_s=wall,
        injected_inf_at=inject_inf if spec.scaled else None,
    )
