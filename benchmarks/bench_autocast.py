"""Overhead of mixprec.autocast against native torch.autocast on a small MLP training step.

All configurations run side by side in one process, interleaved round-robin after a warm-up (so
load drift hits all of them alike); each prints the median (and minimum) microseconds per step and
the ratio of medians to native ``torch.autocast``. Threads are pinned.

Rules change the arithmetic (an fp32 LayerNorm costs more than a bf16 one), so each rule
configuration is also compared with a hand-written native equivalent doing the same arithmetic
(``torch.autocast(enabled=False)`` plus casts inside the module), which isolates mixprec's own cost.

Run: ``python benchmarks/bench_autocast.py [--rounds 15] [--iters 100] [--size tiny|medium]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec

DTYPE = torch.bfloat16


class Fp32(nn.Module):
    """Hand-written fp32 island: what a user writes without mixprec."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.inner(x.float())


def mlp(d_in: int, d: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(d_in, d),
        nn.LayerNorm(d),
        nn.GELU(),
        nn.Linear(d, d),
        nn.LayerNorm(d),
        nn.Linear(d, d),
        nn.Linear(d, 10),
    )


def hand_fp32(model: nn.Sequential, kinds: tuple[type[nn.Module], ...]) -> nn.Sequential:
    m = copy.deepcopy(model)
    for i, layer in enumerate(m):
        if isinstance(layer, kinds):
            m[i] = Fp32(layer)
    return m


def configs(d_in: int, d: int) -> dict[str, tuple[nn.Module, Callable[[], Any]]]:
    torch.manual_seed(0)
    base = mlp(d_in, d)
    ln_rule = mixprec.Policy(modules={nn.LayerNorm: "fp32"})
    gelu_rule = mixprec.Policy(ops={F.gelu: "fp32"})
    return {
        "torch.autocast": (base, lambda: torch.autocast("cpu", dtype=DTYPE)),
        "mixprec, no policy": (
            copy.deepcopy(base),
            lambda: mixprec.autocast("cpu", DTYPE),
        ),
        "mixprec, module rule LayerNorm=fp32": (
            copy.deepcopy(base),
            lambda: mixprec.autocast("cpu", DTYPE, policy=ln_rule),
        ),
        "  native hand-written LayerNorm fp32": (
            hand_fp32(base, (nn.LayerNorm,)),
            lambda: torch.autocast("cpu", dtype=DTYPE),
        ),
        "mixprec, op rule gelu=fp32": (
            copy.deepcopy(base),
            lambda: mixprec.autocast("cpu", DTYPE, policy=gelu_rule),
        ),
        "  native hand-written GELU fp32": (
            hand_fp32(base, (nn.GELU,)),
            lambda: torch.autocast("cpu", dtype=DTYPE),
        ),
    }


def run_steps(
    model: nn.Module,
    ctx: Callable[[], AbstractContextManager[Any]],
    x: torch.Tensor,
    y: torch.Tensor,
    iters: int,
) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        with ctx():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        for p in model.parameters():
            p.grad = None
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--size", choices=["tiny", "medium"], default="tiny")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch, d_in, d = (16, 32, 64) if args.size == "tiny" else (128, 256, 1024)
    x, y = torch.randn(batch, d_in), torch.randint(0, 10, (batch,))
    cfgs = configs(d_in, d)
    for model, ctx in cfgs.values():  # warm-up (also attaches the rule hooks)
        run_steps(model, ctx, x, y, max(3, args.iters // 5))
    times: dict[str, list[float]] = {name: [] for name in cfgs}
    for _ in range(args.rounds):
        for name, (model, ctx) in cfgs.items():
            times[name].append(run_steps(model, ctx, x, y, args.iters))
    base = statistics.median(times["torch.autocast"])
    print(
        f"torch {torch.__version__}, size={args.size} (B={batch}, {d_in}->{d}), "
        f"threads={args.threads}, {args.rounds} rounds x {args.iters} steps, dtype={DTYPE}"
    )
    print(
        f"{'configuration':40s} {'median us':>10s} {'min us':>9s} {'ratio':>7s} {'min ratio':>9s}"
    )
    base_min = min(times["torch.autocast"])
    mixprec_rule = (base, base_min)
    for name, samples in times.items():
        med, low = statistics.median(samples), min(samples)
        line = f"{name:40s} {med:10.1f} {low:9.1f} {med / base:7.3f} {low / base_min:9.3f}"
        if name.startswith("  "):  # hand-written native equivalent of the rule above it
            line += f"   mixprec rule / hand-written: {mixprec_rule[0] / med:.3f}"
            line += f" (min {mixprec_rule[1] / low:.3f})"
        else:
            mixprec_rule = (med, low)
        print(line)


if __name__ == "__main__":
    main()
