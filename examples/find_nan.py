"""Find the layer where an fp16 NaN starts, forward or backward, with mixprec.find_nonfinite.

A small transformer-like MLP stack where one block's activations grow past fp16's 65504 under
autocast. The scaler would only see non-finite gradients and skip; the finder names the block's
layer, the pass, the dtype and the largest finite value, and warns before the overflow.

Run: python examples/find_nan.py
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

import mixprec


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


def main() -> None:
    torch.manual_seed(0)
    width = 16
    model = nn.Sequential(*[Block(width) for _ in range(4)], nn.Linear(width, 1))
    x = torch.randn(8, width)
    with torch.no_grad():  # blocks whose weights drifted large, as in the T5 fp16 overflows
        model[1].down.weight.mul_(1e4)  # activations near fp16's limit: a warning
        model[3].down.weight.mul_(2e5)  # beyond it: inf in the forward pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mixprec.find_nonfinite(model, warn_within=16.0) as finder:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
    for warning in caught:
        print(f"warning: {warning.message}")
    print(finder.report)
    report = finder.report
    if report is not None and report.phase == "forward":
        print(f"-> keep '{report.module}' in float32 (an fp32 island) or rescale it.")


if __name__ == "__main__":
    main()
