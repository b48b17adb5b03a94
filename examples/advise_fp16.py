"""The precision advisor in fp16: the layer that does not fit fp16's range.

A block with large weights (think of a layer pretrained in bf16) produces activations around
1e5, above fp16's maximum of 65504; a LayerNorm brings them back. ``mixprec.advise`` with the
candidate fp16 names that layer (``block.fc``) and proposes keeping it in fp32, with the loss
scale to train with; the model is docs/advisor.md's first walk-through (its blocks show the same
code: tests/docs/test_doc_snippets.py holds them equal).

Run: ``python examples/advise_fp16.py``, or from the command line::

    mixprec advise examples/advise_fp16.py:make_net --candidates fp16 --check
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import mixprec


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        with torch.no_grad():  # large weights: outputs around 1e5
            self.fc.weight.mul_(1e5)
            self.fc.bias.mul_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.block = Block(64)
        self.hidden = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.hidden(self.block(torch.tanh(self.inp(x)))))
        return self.head(x)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return F.mse_loss(model(inputs).float(), targets)


def make_net() -> tuple[Net, tuple[torch.Tensor, torch.Tensor], object]:
    """The model, a batch and the loss function, as docs/advisor.md's walk-through builds them."""
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(256, 32)
    y = torch.sin(x @ torch.randn(32, 8))
    return model, (x, y), loss_fn


def main() -> None:
    model, batch, loss = make_net()
    advice = mixprec.advise(model, batch, loss, candidates=["fp16"], check=True)
    print(advice.table())
    assert str(advice.policy) == "block.fc=fp32", advice.policy


if __name__ == "__main__":
    main()
