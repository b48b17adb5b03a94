"""Several models, losses and optimizers, one scaler.

Use one GradScaler for the whole iteration: scale each loss, ``step`` each optimizer (each one
is unscaled and checked for inf/NaN on its own, and skipped on its own), and call ``update``
once, at the end of the iteration. Here optimizer 0's gradients are also clipped.

    python examples/multiple_models.py         # MIXPREC_EXAMPLE_STEPS=5 for a quick run
"""

from __future__ import annotations

import os

import torch

import mixprec

STEPS = int(os.environ.get("MIXPREC_EXAMPLE_STEPS", "50"))
device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(0)
model0 = torch.nn.Linear(16, 4).to(device)
model1 = torch.nn.Linear(16, 4).to(device)
optimizer0 = torch.optim.SGD(model0.parameters(), lr=0.1)
optimizer1 = torch.optim.Adam(model1.parameters(), lr=1e-2)
scaler = mixprec.GradScaler()
x = torch.randn(64, 16, device=device)
target = torch.randn(64, 4, device=device)

for _ in range(STEPS):
    optimizer0.zero_grad()
    optimizer1.zero_grad()
    with mixprec.autocast(device, dtype=torch.float16):
        out0, out1 = model0(x), model1(x)
        loss0 = torch.nn.functional.mse_loss(0.7 * out0 + 0.3 * out1, target)
        loss1 = torch.nn.functional.l1_loss(0.4 * out0 + 0.6 * out1, target)

    # Both losses contribute to both models' gradients; retain the graph for the second backward.
    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()

    # Optional: clip optimizer0's gradients, which must be unscaled first.
    scaler.unscale_(optimizer0)
    torch.nn.utils.clip_grad_norm_(model0.parameters(), max_norm=1.0)

    scaler.step(optimizer0)  # already unscaled: not unscaled twice
    scaler.step(optimizer1)
    scaler.update()  # once per iteration, after every optimizer stepped

print(f"loss0 {loss0.item():.4f}, loss1 {loss1.item():.4f}, scale {scaler.get_scale():g}")
assert torch.isfinite(loss0) and torch.isfinite(loss1)
