"""Mixed precision with a policy: fp32 islands, a bf16 subtree, op rules and the dtype report.

Runs on the CPU in a few seconds: ``python examples/autocast_policy.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import mixprec


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = F.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.out(weights @ v)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self, d: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(Block(d) for _ in range(depth))
        self.router = nn.Linear(d, 4)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.encoder:
            x = block(x)
        gate = torch.softmax(self.router(x.float()), dim=-1)  # the router manages its own dtypes
        return (self.head(x) * gate).mean(1)


def main() -> None:
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = mixprec.GradScaler()  # fp16 needs loss scaling
    x, y = torch.randn(8, 6, 32), torch.randint(0, 4, (8,))

    policy = mixprec.Policy(
        modules={
            nn.LayerNorm: "fp32",  # fp32 island: inputs cast up, autocast off inside
            "encoder.*.attn": torch.bfloat16,  # a subtree in another low-precision dtype
            "router": "keep",  # autocast off, no casts
        },
        ops={F.softmax: "fp32", "aten::gelu": "low"},
    )
    print("policy:", policy)  # the short string form; mixprec.Policy(str(policy)) == policy
    table = mixprec.policy_table("cpu", policy, model=model)  # static view, nothing runs
    for row in table.rows:
        if row.rule != "-" or row.target in ("aten::linear", "aten::layer_norm"):
            print(f"  {row.kind:6s} {row.target:24s} native={row.native:20s} -> {row.effective}")
    print()

    for step in range(3):
        optimizer.zero_grad()
        with mixprec.autocast("cpu", torch.float16, policy=policy, report=step == 0) as ac:
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step}: loss {loss.item():.4f}")
        if ac.report is not None:
            print(ac.report, "\n")


if __name__ == "__main__":
    main()
