"""mixprec.Watch catches a policy going stale during training, before the loss does.

A regression MLP is advised at step 0 (every Linear in fp8, tensorwise scaling). From step 60
a few rows of each batch, "sink" tokens that the loss leaves out, grow massive activations (as
large language models grow on their first tokens): by step 110 they are 10^6 times the others.
In float32 or bf16 this changes nothing (each row is computed on its own, and the sink rows get
no gradient), but an fp8 tensor's single scale is set by its largest value: the sinks squeeze
every other value below the format's range, where it is flushed to zero. The same model trained
in bf16, side by side, is the reference.

The watch re-measures one module every 10 steps, in turn (two passes each check, one more the
first time). It raises an alert when a module's fp8 flushed fraction rises, or when it loses
ground against bf16 at the same step, and proposes the policy the new figures give (here:
rowwise scaling, whose per-row scales the sinks cannot squeeze). The loss tells the same story
only later.

Run: ``python examples/watch_drift.py`` (a few seconds).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec

WIDTH, ROWS, SINKS, STEPS = 32, 256, 4, 150
DRIFT_FROM, DRIFT_STEPS, DRIFT_DECADES = 60, 50, 6


def sink_gain(step: int) -> float:
    """How much larger the sink rows are at ``step``: 1, then 10x every 8 steps, up to 10^6."""
    return 10 ** (DRIFT_DECADES * min(1.0, max(0, step - DRIFT_FROM) / DRIFT_STEPS))


TARGET = torch.randn(WIDTH, 8, generator=torch.Generator().manual_seed(3)) / math.sqrt(WIDTH)


def make_batch(step: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(ROWS, WIDTH, generator=gen)
    y = torch.sin(x @ TARGET)
    x[:SINKS] *= sink_gain(step)
    return x, y


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)
    )


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x)[SINKS:].float(), y[SINKS:])  # the sink rows carry no loss


def train(policy: Any, watch_with: Any = None) -> tuple[list[float], list[Any]]:
    """``STEPS`` Adam steps under bf16 autocast with ``policy``; the watch's alerting reports."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    watch = None if watch_with is None else mixprec.Watch(model, loss_fn, watch_with, every=10)
    gen = torch.Generator().manual_seed(2)
    losses, alerts = [], []
    for step in range(STEPS):
        batch = make_batch(step, gen)
        optimizer.zero_grad(set_to_none=True)
        with mixprec.autocast("cpu", dtype=torch.bfloat16, policy=policy):
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if watch is not None:
            with warnings.catch_warnings(record=True):  # printed below instead
                warnings.simplefilter("always", mixprec.errors.MixprecWarning)
                report = watch.step(batch)
            if report is not None and report.alerts:
                alerts.append((step, report))
    return losses, alerts


def first_loss_gap(low: list[float], ref: list[float], factor: float = 1.5) -> int | None:
    """The first step where the fp8 run's loss, averaged over 10 steps, exceeds ``factor``
    times the bf16 run's."""
    for step in range(10, len(low)):
        if sum(low[step - 10 : step]) > factor * sum(ref[step - 10 : step]):
            return step
    return None


def main() -> None:
    torch.set_num_threads(1)  # a small model: one thread is as fast, and steadier
    advice = mixprec.advise(
        make_model(),
        make_batch(0, torch.Generator().manual_seed(1)),
        loss_fn,
        candidates=["fp8", "fp8:rowwise"],
        min_sqnr=25.0,
    )
    print(f"step 0 advice: {advice.policy} (predicted {advice.predicted_sqnr:.1f} dB)")
    reference, _ = train(None)
    low, alerts = train(advice.policy, watch_with=advice)
    assert alerts, "the watch raised no alert"
    caught, report = alerts[0]
    noticed = first_loss_gap(low, reference)
    print(
        f"\nsinks start growing at step {DRIFT_FROM}; at step {caught} they are "
        f"{sink_gain(caught):.0f}x the other rows"
    )
    print(f"the watch's first alert, step {caught}:")
    for alert in report.alerts:
        print(f"  {alert}")
    print(f"  proposal: {report.policy}")
    print(f"the fp8 loss is 1.5x the bf16 loss from step {noticed}")
    print("\nstep   sink gain   bf16 loss   fp8 loss")
    for step in range(DRIFT_FROM - 10, STEPS, 10):
        print(f"{step:4d}  {sink_gain(step):10.0e}  {reference[step]:10.4f}  {low[step]:9.4f}")
    assert noticed is not None and caught < noticed
    assert report.policy is not None and "rowwise" in str(report.policy)


if __name__ == "__main__":
    main()
