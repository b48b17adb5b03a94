"""Tiny models and a differential runner shared by the autocast tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

import mixprec


class MLP(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 32)
        self.norm = nn.LayerNorm(32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.norm(self.fc1(x))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.relu(self.bn(self.conv(x)))).flatten(1))


class Attn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        w = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.proj(w @ v)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attn(d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Encoder(nn.Module):
    def __init__(self, d: int = 16, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Transformer(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.encoder = Encoder(d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(x))).mean(1)


def make(kind: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A model, an input and integer targets (4 classes), deterministic in ``seed``."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP(), torch.randn(8, 16), torch.randint(0, 4, (8,))
    if kind == "cnn":
        return CNN(), torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    if kind == "transformer":
        return Transformer(), torch.randn(2, 5, 16), torch.randint(0, 4, (2,))
    raise ValueError(kind)


def step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    ctx: Callable[[], AbstractContextManager[Any]],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward + loss inside ``ctx()``, backward outside; returns the output and the grads."""
    model.zero_grad(set_to_none=True)
    with ctx():
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
    loss.backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


def run(model: nn.Module, x: torch.Tensor, policy: Any) -> list[torch.Tensor]:
    """Forward in a bf16 region under ``policy``, backward outside: the output and the grads
    (of the original module's parameters when ``model`` is a ``torch.compile`` wrapper)."""
    model.zero_grad(set_to_none=True)
    with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
        out = model(x)
    out.float().square().mean().backward()
    params = model._orig_mod.parameters() if hasattr(model, "_orig_mod") else model.parameters()
    return [out.detach(), *(p.grad.clone() for p in params if p.grad is not None)]


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype, f"{what}: tensor {i} is {a.dtype}, eager gives {b.dtype}"
        assert torch.equal(a, b), f"{what}: tensor {i} differs from eager"


@contextmanager
def graphs() -> Iterator[dict[str, int]]:
    """How many graphs Dynamo compiled inside the block."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    found: dict[str, int] = {}
    yield found
    found["graphs"] = counters["stats"]["unique_graphs"] - before
