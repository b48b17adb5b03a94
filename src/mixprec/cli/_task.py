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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec.cli._eager import EagerAdam

__all__ = ["RunResult", "RunSpec", "Task", "make_task", "train"]

D_IN, WIDTH, D_OUT = 32, 64, 64
N_TRAIN, N_TEST, BATCH = 8192, 2048, 512
TARGET_SCALE = 0.01
LR = 3e-3
#: Shorter than the default 2000 so that a few hundred steps show the scale growing.
GROWTH_INTERVAL = 15
#: How many times per run the low-precision gradients are compared with float32 ones.
PROBES = 30
#: The power-of-two bins of the gradient histograms: [2^LOG2_LOW, 2^(LOG2_HIGH + 1)).
LOG2_LOW, LOG2_HIGH = -56, 23


@dataclass(frozen=True)
class RunSpec:
    """One of the three runs: its name, whether autocast is on, whether a scaler is used."""

    name: str
    autocast: bool
    scaled: bool


@dataclass
class GradHistogram:
    """How many gradient values fell into each power-of-two bin ``[2^k, 2^(k+1))``.

    ``outputs[i]`` and ``weights[i]`` count bin ``k = log2_low + i``; values outside the bins are
    counted in the end ones. The values are the float32 reference gradients of the probes, times
    the scale of that step when ``scaled``: what backward must hold in low precision.
    ``outputs``: gradients w.r.t. each layer's output (the signal backward passes down);
    ``weights``: gradients w.r.t. the weights and biases. ``zeros``: values exactly 0 in float32.
    """

    log2_low: int
    outputs: list[int]
    weights: list[int]
    zeros: int
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
    probe_steps: list[int] = field(default_factory=list)
    flushed_by_probe: list[float] = field(default_factory=list)
    gradients: GradHistogram | None = None


@dataclass(frozen=True)
class Task:
    """Data (train/test), the initial model and the seed of the batch order, shared by the runs."""

    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    model: nn.Module
    steps: int
    seed: int

    def batches(self) -> Iterator[torch.Tensor]:
        """``steps`` index batches into ``x``: a fresh permutation per epoch, drawn as needed
        (the same order on every call), so a long run allocates nothing up front."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        per_epoch = len(self.x) // BATCH
        for step in range(self.steps):
            if step % per_epoch == 0:
                order = torch.randperm(len(self.x), generator=gen).to(self.x.device)
            i = step % per_epoch
            yield order[i * BATCH : (i + 1) * BATCH]


def _target(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(D_IN, D_OUT, generator=gen) / math.sqrt(D_IN)
    return TARGET_SCALE * torch.sin(1.5 * x @ w)


def make_task(seed: int, steps: int, device: torch.device) -> Task:
    """Generate the data and the model from ``seed`` (nothing is downloaded)."""
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
    return Task(
        x[:N_TRAIN].to(device),
        y[:N_TRAIN].to(device),
        x[N_TRAIN:].to(device),
        y[N_TRAIN:].to(device),
        model.to(device),
        steps,
        seed,
    )


def probe_steps(steps: int) -> list[int]:
    """The steps at which a low-precision run is compared with float32 (:data:`PROBES` of them,
    spread evenly, the first and the last included)."""
    return sorted({round(i * (steps - 1) / max(PROBES - 1, 1)) for i in range(min(PROBES, steps))})


class _Probe:
    """At a few steps, repeat the backward pass in float32 and compare (see :meth:`measure`)."""

    def __init__(self, steps: int, scaled: bool) -> None:
        self.at = set(probe_steps(steps))
        self.steps: list[int] = []
        self.flushed: list[float] = []
        self.lost = self.total = self.zeros = 0
        self.outputs = torch.zeros(LOG2_HIGH - LOG2_LOW + 1, dtype=torch.int64)
        self.weights = torch.zeros_like(self.outputs)
        self.scaled = scaled
        self.seconds = 0.0

    def measure(
        self, step: int, model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float
    ) -> None:
        """Count the gradient elements that are zero in ``model``'s (low-precision) grads but
        not in a float32 backward at the same point, and histogram the float32 gradients
        (w.r.t. every module's output and every weight) times ``scale``."""
        t0 = time.perf_counter()
        low = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        ref_model = copy.deepcopy(model)
        ref_model.zero_grad(set_to_none=True)
        outputs: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(_keep_grad(outputs)) for m in ref_model.children()]
        nn.functional.mse_loss(ref_model(x), y).backward()
        for hook in hooks:
            hook.remove()
        ref = [p.grad for p in ref_model.parameters() if p.grad is not None]
        lost = sum(int(((lo == 0) & (r != 0)).sum()) for lo, r in zip(low, ref, strict=True))
        total = sum(int((r != 0).sum()) for r in ref)
        self.steps.append(step)
        self.flushed.append(lost / total if total else 0.0)
        self.lost, self.total = self.lost + lost, self.total + total
        for o in outputs:
            if o.grad is not None:
                self._histogram(self.outputs, o.grad, scale)
        for g in ref:
            self._histogram(self.weights, g, scale)
        self.seconds += time.perf_counter() - t0

    def _histogram(self, counts: torch.Tensor, grad: torch.Tensor, scale: float) -> None:
        magnitudes = grad.detach().abs().flatten()
        nonzero = magnitudes[magnitudes > 0]
        self.zeros += magnitudes.numel() - nonzero.numel()
        log2 = torch.floor(torch.log2(nonzero.double()) + math.log2(scale))
        bins = log2.clamp(LOG2_LOW, LOG2_HIGH).long() - LOG2_LOW
        counts += torch.bincount(bins.cpu(), minlength=len(counts))

    def histogram(self) -> GradHistogram:
        outputs, weights = self.outputs.tolist(), self.weights.tolist()
        return GradHistogram(LOG2_LOW, outputs, weights, self.zeros, self.scaled)


def _keep_grad(outputs: list[torch.Tensor]) -> Callable[..., None]:
    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.retain_grad()
            outputs.append(output)

    return hook


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
    """Train a copy of ``task.model`` with Adam for ``task.steps`` steps.

    ``inject_inf`` (scaled runs only) writes an inf into one gradient at that step, as an fp16
    overflow would, to show the skip and the backoff.
    """
    device = task.x.device
    model = copy.deepcopy(task.model)
    opt = EagerAdam(model.parameters(), lr=LR)
    scaler = _make_scaler(spec, device, task.steps)
    probe = _Probe(task.steps, spec.scaled)
    losses: list[float] = []
    start = time.perf_counter()
    for step, idx in enumerate(task.batches()):
        xb, yb = task.x[idx], task.y[idx]
        opt.zero_grad(set_to_none=True)
        with mixprec.autocast(device.type, dtype=dtype, enabled=spec.autocast):
            loss = nn.functional.mse_loss(model(xb).float(), yb)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if spec.autocast and step in probe.at:
            probe.measure(step, model, xb, yb, scaler.get_scale() if scaler is not None else 1.0)
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
    wall = time.perf_counter() - start - probe.seconds
    test_loss, r2 = _r2(model, task)
    return _result(spec, dtype, losses, test_loss, r2, probe, scaler, wall, inject_inf)


def _result(
    spec: RunSpec,
    dtype: torch.dtype,
    losses: list[float],
    test_loss: float,
    r2: float,
    probe: _Probe,
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
        flushed_fraction=probe.lost / probe.total if spec.autocast and probe.total else None,
        steps_skipped=scaler.stats().steps_skipped if scaler is not None else 0,
        skipped_steps=[h.iteration - 1 for h in history if h.skipped],
        scales=[h.scale for h in history],
        final_scale=scaler.get_scale() if scaler is not None else None,
        wall_s=wall,
        injected_inf_at=inject_inf if spec.scaled else None,
        probe_steps=probe.steps,
        flushed_by_probe=probe.flushed,
        gradients=probe.histogram() if spec.autocast else None,
    )
