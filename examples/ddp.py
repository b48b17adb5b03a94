"""DistributedDataParallel on 2 processes (CPU, gloo), with autocast and GradScaler.

Nothing about the scaler changes under DDP: DDP averages the gradients during ``backward`` (an
inf on one rank becomes an inf on all), so every rank finds the same overflow, skips the same
steps and keeps the same scale. For FSDP or hand-sharded gradients, pass
``GradScaler(process_group=...)`` so that the ranks agree (see docs/distributed.md).

This script spawns its own 2 processes on 127.0.0.1 and stops them after a time limit.

    python examples/ddp.py                     # MIXPREC_EXAMPLE_STEPS=5 for a quick run
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import mixprec

STEPS = int(os.environ.get("MIXPREC_EXAMPLE_STEPS", "30"))
WORLD_SIZE = 2
TIME_LIMIT_S = 120
OVERFLOW_AT = 2  # rank 1 alone gets an inf gradient at this step


def worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        train(rank)
        # Leave together: a rank tearing gloo down while its peer is still connected can abort
        # the peer ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train(rank: int) -> None:
    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts them)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = mixprec.GradScaler()
    data = torch.Generator().manual_seed(rank)  # each rank sees its own shard
    for step in range(STEPS):
        x = torch.randn(32, 8, generator=data)
        y = x.sum(1, keepdim=True) / 4
        optimizer.zero_grad()
        with mixprec.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if step == OVERFLOW_AT and rank == 1:
            loss = loss * math.inf  # only this rank overflows...
        scaler.scale(loss).backward()  # ...but DDP's all-reduce spreads the inf to every rank
        scaler.step(optimizer)
        scaler.update()
    stats = scaler.stats()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    flat = torch.cat([flat, torch.tensor([float(stats.steps_skipped), stats.scale])])
    gathered = [torch.empty_like(flat) for _ in range(WORLD_SIZE)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(gathered[0], g) for g in gathered)
    print(
        f"rank {rank}: loss {loss.item():.4f}, skipped {stats.steps_skipped}, "
        f"scale {stats.scale:g}, parameters, skips and scale identical across ranks: {same}",
        flush=True,
    )
    if not same or stats.steps_skipped < 1:
        raise RuntimeError(f"rank {rank}: ranks disagree or the overflow was not skipped")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    context = mp.spawn(worker, args=(free_port(),), nprocs=WORLD_SIZE, join=False)
    deadline = TIME_LIMIT_S
    while not context.join(timeout=1):  # raises if a worker failed
        deadline -= 1
        if deadline <= 0:
            for process in context.processes:
                process.kill()
            print(f"ddp example: stopped after {TIME_LIMIT_S} s", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
