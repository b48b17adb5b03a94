"""Small models for the advisor tests (the GPT-like model lives in examples/advise_gpt.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: The "loud" block's weights are this many times their default initialisation: its outputs
#: reach about 1e5, above the float16 maximum (65504).
LOUD_GAIN = 1e5


class Loud(nn.Module):
    """A block with large-magnitude weights followed by a LayerNorm that brings values back."""

    def __init__(self, d: int, gain: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        with torch.no_grad():
            self.fc.weight.mul_(gain)
            self.fc.bias.mul_(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


class LoudNet(nn.Module):
    """An MLP regression whose middle block's activations exceed the float16 range."""

    def __init__(self, gain: float = LOUD_GAIN) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.loud = Loud(64, gain)
        self.hidden = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        x = torch.tanh(self.hidden(self.loud(x)))
        return self.head(x)


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def loud_task(seed: int = 0, gain: float = LOUD_GAIN) -> tuple[nn.Module, Any, Any]:
    """(model, batch, loss function) for the float16 target."""
    torch.manual_seed(seed)
    model = LoudNet(gain)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(256, 32, generator=gen)
    y = torch.sin(x @ torch.randn(32, 8, generator=gen))
    return model, (x, y), mse


class Small(nn.Module):
    """Linear, BatchNorm (buffers), Dropout (RNG), Conv: the state the advisor must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(8 * 16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.out(torch.relu(self.fc(h.flatten(1))))


def small_task(seed: int = 0) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(seed)
    model = Small()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(32, 4, 16, generator=gen)
    y = torch.randn(32, 4, generator=gen)
    return model, (x, y), mse


def not_a_triple() -> Any:
    """A factory that returns the wrong thing (for the command-line tests)."""
    model, batch, _ = loud_task()
    return model, batch


def not_a_model() -> Any:
    return "model", None, mse


NOT_CALLABLE = 3
