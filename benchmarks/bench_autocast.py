"""Overhead of mixprec.autocast against native torch.autocast on a small MLP training step.

All configurations run side by side in one process: after a warm-up, each round runs every
configuration for a few steps in a shuffled order. Printed per configuration: the median
microseconds per step, the ratio of medians to native ``torch.autocast``, and the median of the
per-round ratios (paired, so load drift on a shared machine cancels). Threads are pinned.

Rules change the arithmetic (an fp32 LayerNorm costs more than a bf16 one), so each rule
configuration is also compared with a hand-written native equivalent doing the same arithmetic
(``torch.autocast(enabled=False)`` plus casts inside the module), which isolates mixprec's own cost.

``--construction`` measures instead what a training loop pays to build a policy (and a region
with it) every step, against entering and leaving a ``torch.autocast``, side by side.

``--region`` times the no-policy region itself inside a training step (building it, entering,
leaving; caches are cold there, unlike in a loop of empty regions), against ``torch.autocast``.

``--reuse`` measures what mixprec's training regions pay for casting weights per use instead of
through torch's weight cache (the change that makes checkpoint recomputation exact): a block
whose weight is used ``--uses`` times in one region; step time against ``torch.autocast``, and the
bytes autograd keeps for backward.

Run: ``python benchmarks/bench_autocast.py [--rounds 200] [--iters 10] [--size tiny|medium]
[--device cpu|cuda] [--dtype bf16|fp16] [--construction] [--region] [--reuse [--uses 4]]``.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec

DEVICE = "cpu"  # set from --device in main()
DTYPE = torch.bfloat16  # set from --dtype in main()


class Fp32(nn.Module):
    """Hand-written fp32 island: what a user writes without mixprec."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(DEVICE, enabled=False):
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
        "torch.autocast": (base, lambda: torch.autocast(DEVICE, dtype=DTYPE)),
        "torch.autocast again (A/A control)": (  # its ratio shows the noise floor of this run
            base,
            lambda: torch.autocast(DEVICE, dtype=DTYPE),
        ),
        "mixprec, no policy": (  # the same model object as native: nothing attaches to it
            base,
            lambda: mixprec.autocast(DEVICE, DTYPE),
        ),
        "mixprec, module rule LayerNorm=fp32": (
            copy.deepcopy(base),
            lambda: mixprec.autocast(DEVICE, DTYPE, policy=ln_rule),
        ),
        "  native hand-written LayerNorm fp32": (
            hand_fp32(base, (nn.LayerNorm,)),
            lambda: torch.autocast(DEVICE, dtype=DTYPE),
        ),
        "mixprec, op rule gelu=fp32": (
            copy.deepcopy(base),
            lambda: mixprec.autocast(DEVICE, DTYPE, policy=gelu_rule),
        ),
        "  native hand-written GELU fp32": (
            hand_fp32(base, (nn.GELU,)),
            lambda: torch.autocast(DEVICE, dtype=DTYPE),
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
    if DEVICE == "cuda":
        torch.cuda.synchronize()  # time the work, not the launches
    return (time.perf_counter() - start) / iters * 1e6


def measure(
    cfgs: dict[str, tuple[nn.Module, Callable[[], Any]]],
    x: torch.Tensor,
    y: torch.Tensor,
    rounds: int,
    iters: int,
) -> dict[str, list[float]]:
    """Per-round times; each round runs every configuration once, in a shuffled order."""
    for model, ctx in cfgs.values():  # warm-up (also attaches the rule hooks)
        run_steps(model, ctx, x, y, max(3, iters))
    times: dict[str, list[float]] = {name: [] for name in cfgs}
    order = list(cfgs)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            model, ctx = cfgs[name]
            times[name].append(run_steps(model, ctx, x, y, iters))
    return times


def report(times: dict[str, list[float]]) -> None:
    """Medians, and medians of per-round (paired) ratios, which cancel slow load drift."""
    base = next(iter(times.values()))  # the first configuration is the reference
    print(f"{'configuration':40s} {'median us':>10s} {'ratio':>7s} {'paired ratio':>13s}")
    rule: list[float] = base
    for name, samples in times.items():
        paired = statistics.median(s / b for s, b in zip(samples, base, strict=True))
        med = statistics.median(samples)
        line = f"{name:40s} {med:10.1f} {med / statistics.median(base):7.3f} {paired:13.3f}"
        if name.startswith("  "):  # hand-written native equivalent of the rule above it
            own = statistics.median(r / h for r, h in zip(rule, samples, strict=True))
            line += f"   mixprec rule / hand-written (paired): {own:.3f}"
        else:
            rule = samples
        print(line)


def construction_cases() -> dict[str, Callable[[], Any]]:
    """Per-step construction: policies built from literals, and regions built with them."""

    def native() -> None:
        region = torch.autocast(DEVICE, dtype=DTYPE)
        region.__enter__()
        region.__exit__(None, None, None)

    many = {
        nn.LayerNorm: "fp32",
        "enc.*.attn": torch.bfloat16,
        "router": "keep",
        nn.Embedding: "fp32",
    }
    return {
        "torch.autocast enter+exit (reference)": native,
        "Policy(modules={nn.LayerNorm: 'fp32'})": lambda: mixprec.Policy(
            modules={nn.LayerNorm: "fp32"}
        ),
        "Policy(ops={F.gelu: 'fp32'})": lambda: mixprec.Policy(ops={F.gelu: "fp32"}),
        "Policy('nn.LayerNorm=fp32, F.gelu=fp32')": lambda: mixprec.Policy(
            "nn.LayerNorm=fp32, F.gelu=fp32"
        ),
        "Policy(4 module rules, 2 op rules)": lambda: mixprec.Policy(
            modules=many, ops={F.softmax: "fp32", "aten::gelu": "low"}
        ),
        "autocast(policy=Policy(...)) built": lambda: mixprec.autocast(
            DEVICE, DTYPE, policy=mixprec.Policy(modules={nn.LayerNorm: "fp32"})
        ),
        "autocast(policy='nn.LayerNorm=fp32') built": lambda: mixprec.autocast(
            DEVICE, DTYPE, policy="nn.LayerNorm=fp32"
        ),
    }


def measure_calls(
    cases: dict[str, Callable[[], Any]], rounds: int, calls: int
) -> dict[str, list[float]]:
    """Microseconds per call, per round; each round runs every case in a shuffled order."""
    for fn in cases.values():
        for _ in range(calls):
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    order = list(cases)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            fn = cases[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return times


def report_calls(times: dict[str, list[float]]) -> None:
    base = next(iter(times.values()))
    print(f"{'per-step construction':45s} {'median us':>10s} {'paired ratio':>13s}")
    for name, samples in times.items():
        paired = statistics.median(s / b for s, b in zip(samples, base, strict=True))
        print(f"{name:45s} {statistics.median(samples):10.2f} {paired:13.3f}")


class Reused(nn.Module):
    """One Linear applied ``uses`` times (a shared block, a recurrent cell), then a head."""

    def __init__(self, d: int, uses: int) -> None:
        super().__init__()
        self.inp, self.lin, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 10)
        self.uses = uses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.uses):
            h = torch.relu(self.lin(h))
        return self.head(h)


def reuse_configs(d: int, uses: int) -> dict[str, tuple[nn.Module, Callable[[], Any]]]:
    torch.manual_seed(0)
    model = Reused(d, uses)
    return {
        "torch.autocast (weight cache)": (model, lambda: torch.autocast(DEVICE, dtype=DTYPE)),
        "mixprec (a cast per use)": (model, lambda: mixprec.autocast(DEVICE, DTYPE)),
        "torch.autocast(cache_enabled=False)": (
            model,
            lambda: torch.autocast(DEVICE, dtype=DTYPE, cache_enabled=False),
        ),
    }


def saved_bytes(model: nn.Module, ctx: Callable[[], Any], x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in one step."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx():
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def region_phases(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, rounds: int
) -> dict[str, list[tuple[float, ...]]]:
    """Microseconds to build, enter and leave each region inside a training step, per step."""
    makers: dict[str, Callable[[], Any]] = {
        "torch.autocast": lambda: torch.autocast(DEVICE, dtype=DTYPE),
        "mixprec.autocast": lambda: mixprec.autocast(DEVICE, DTYPE),
    }
    clock = time.perf_counter
    out: dict[str, list[tuple[float, ...]]] = {name: [] for name in makers}
    for i in range(rounds + 20):
        for name, make in makers.items():
            t0 = clock()
            region = make()
            t1 = clock()
            region.__enter__()
            t2 = clock()
            loss = F.cross_entropy(model(x), y)
            t3 = clock()
            region.__exit__(None, None, None)
            t4 = clock()
            loss.backward()
            for p in model.parameters():
                p.grad = None
            if i >= 20:  # warm-up
                out[name].append(tuple(1e6 * d for d in (t1 - t0, t2 - t1, t4 - t3)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--size", choices=["tiny", "medium"], default="tiny")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--construction", action="store_true", help="per-step construction cost")
    parser.add_argument("--region", action="store_true", help="the region's own cost in a step")
    parser.add_argument("--reuse", action="store_true", help="a weight used several times")
    parser.add_argument("--uses", type=int, default=4)
    args = parser.parse_args()
    global DEVICE, DTYPE
    DEVICE = args.device
    DTYPE = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    torch.set_num_threads(args.threads)
    if args.construction:
        print(f"torch {torch.__version__}, {args.rounds} rounds x 300 calls, device={DEVICE}")
        report_calls(measure_calls(construction_cases(), args.rounds, 300))
        return
    batch, d_in, d = (16, 32, 64) if args.size == "tiny" else (128, 256, 1024)
    if args.reuse:
        d_in = d
    x = torch.randn(batch, d_in, device=DEVICE)
    y = torch.randint(0, 10, (batch,), device=DEVICE)
    if args.region:
        torch.manual_seed(0)
        phases = region_phases(mlp(d_in, d).to(DEVICE), x, y, args.rounds * args.iters)
        print(f"{'median us per step':25s} {'build':>7s} {'enter':>7s} {'exit':>7s} {'sum':>7s}")
        for name, rows in phases.items():
            cols = [statistics.median(r[i] for r in rows) for i in range(3)]
            print(f"{name:25s} {cols[0]:7.1f} {cols[1]:7.1f} {cols[2]:7.1f} {sum(cols):7.1f}")
        return
    made = reuse_configs(d, args.uses) if args.reuse else configs(d_in, d)
    cfgs = {name: (model.to(DEVICE), ctx) for name, (model, ctx) in made.items()}
    times = measure(cfgs, x, y, args.rounds, args.iters)
    print(
        f"torch {torch.__version__}, size={args.size} (B={batch}, {d_in}->{d}), "
        f"threads={args.threads}, {args.rounds} rounds x {args.iters} steps, "
        f"device={DEVICE}, dtype={DTYPE}"
    )
    report(times)
    if args.reuse:
        print(f"one Linear({d}, {d}) used {args.uses} times per region; saved for backward:")
        for name, (model, ctx) in cfgs.items():
            print(f"  {name:40s} {saved_bytes(model, ctx, x, y) / 2**20:8.3f} MiB")


if __name__ == "__main__":
    main()
