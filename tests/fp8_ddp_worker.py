"""One rank of the 2-process gloo world that tests/fp8/test_fp8_rule.py spawns: DDP + an fp8 rule.

Usage: ``python fp8_ddp_worker.py RANK WORLD_SIZE PORT_FILE OUTDIR``; writes
``OUTDIR/fp8-<rank>.pt`` (the parameters after a few steps, and the first step's loss).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mixprec
from dist_worker import run_rank


def train(rank: int, world: int, outdir: Path, args: list[str]) -> None:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = mixprec.Policy("nn.Linear=fp8:rowwise")
    gen = torch.Generator().manual_seed(rank)  # each rank its own batches
    losses = []
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
        with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
            out = model(x)
        loss = (out.float() - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    torch.save({"params": params, "losses": losses}, outdir / f"fp8-{rank}.pt")


if __name__ == "__main__":
    run_rank(sys.argv[1:], train)
