"""What a model's forward costs after a policy region has run and exited, against before.

A policy region with module rules adds two process-wide module hooks to torch; the last region to
exit removes them, so that afterwards every forward in the process (of any model) costs what it
cost before. Three processes run side by side, round by round, the order rotating; all import
mixprec. Each round all run the same bf16 training step, ``after`` in a policy region, ``before``
and ``control`` without any region, then time the same forward (a 49-module MLP, fp32, no
region) twice; ``after`` times the second with mixprec's hooks kept in torch (what every release
before #36 left there). ``control`` does what ``before`` does: its ratio is the noise floor of
comparing two processes. All do the same work, and the paired per-round ratios against
``before`` cancel load drift on a shared machine. Threads are pinned to 1 in each process.

Run: ``python benchmarks/bench_after_region.py [--rounds 60] [--iters 200]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

import torch
from torch import nn

POLICY = "nn.LayerNorm=fp32, 0=fp32"


def model() -> nn.Module:
    """49 modules: the root, 24 Linear+ReLU pairs."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    return nn.Sequential(*layers)


def train_step(net: nn.Module, x: torch.Tensor, policy: str | None) -> None:
    """A bf16 training step, in a region with ``policy`` or without any region."""
    import mixprec

    net.zero_grad(set_to_none=True)
    if policy is None:
        out = net(x)
    else:
        with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
            out = net(x)
    out.float().sum().backward()


def time_forwards(net: nn.Module, x: torch.Tensor, iters: int) -> float:
    """Median microseconds of one forward over ``iters`` forwards."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        net(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def worker(conn: Connection, role: str, iters: int, threads: int) -> None:
    torch.set_num_threads(threads)
    import mixprec  # noqa: F401  (imported in both: only the region differs)
    from mixprec._src.autocast.modules import acquire_global_hooks, release_global_hooks

    net, x = model(), torch.randn(8, 32)
    for _ in range(5):  # warm-up
        time_forwards(net, x, iters)
    policy = POLICY if role == "after" else None
    while conn.recv():
        train_step(net, x, policy)  # the same step; only "after" runs it in a policy region
        plain = time_forwards(net, x, iters)
        if role != "after":  # the same work, torch untouched by mixprec
            conn.send((plain, time_forwards(net, x, iters)))
            continue
        acquire_global_hooks()  # mixprec's hooks left in torch, as every release before #36
        kept = time_forwards(net, x, iters)
        release_global_hooks()
        conn.send((plain, kept))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads, each process"
    )
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    pipes, procs = {}, []
    roles = ("before", "control", "after")
    for role in roles:
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(theirs, role, args.iters, args.threads))
        proc.start()
        pipes[role], procs = ours, [*procs, proc]
    rows: dict[str, list[float]] = {"before": [], "control": [], "after": [], "kept": []}
    for r in range(args.rounds):
        order = roles[r % 3 :] + roles[: r % 3]  # each role first in turn
        for role in order:
            pipes[role].send(True)
            plain, kept = pipes[role].recv()
            rows[role].append(plain)
            if role == "after":
                rows["kept"].append(kept)
    for pipe in pipes.values():
        pipe.send(False)
    for proc in procs:
        proc.join()
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), "
        f"{args.rounds} rounds x {args.iters} forwards"
    )
    print(f"{'forward of a 49-module MLP':55s} {'median us':>10s} {'paired ratio':>13s}")
    base = rows["before"]
    labels = {
        "before": "before any policy region",
        "control": "before, a second process (A/A control) / before",
        "after": "after a policy region / before",
        "kept": "with mixprec's hooks kept in torch (pre-#36) / before",
    }
    for key, label in labels.items():
        paired = statistics.median(a / b for a, b in zip(rows[key], base, strict=True))
        print(f"{label:55s} {statistics.median(rows[key]):10.1f} {paired:12.3f}x")


if __name__ == "__main__":
    main()
