"""Gradient accumulation: several micro-batches per optimizer step.

Scale every micro-batch's loss with the same scale (do not call ``update`` in between), divide it
by the number of micro-batches, and call ``step``/``update`` once per effective batch. The scale
is then the same for all the gradients that are summed.

    python examples/grad_accumulation.py       # MIXPREC_EXAMPLE_STEPS=5 for a quick run
"""

from __future__ import annotations

import os

import torch

import mixprec

STEPS = int(os.environ.get("MIXPREC_EXAMPLE_STEPS", "40"))
ACCUMULATE = 4
device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(0)
model = torch.nn.Linear(32, 1).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = mixprec.GradScaler()
w_true = torch.randn(32, 1, device=device)

for _ in range(STEPS):
    x = torch.randn(ACCUMULATE * 16, 32, device=device)
    y = x @ w_true
    optimizer.zero_grad()
    for xb, yb in zip(x.chunk(ACCUMULATE), y.chunk(ACCUMULATE), strict=True):
        with mixprec.autocast(device, dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(xb).float(), yb) / ACCUMULATE
        scaler.scale(loss).backward()  # gradients accumulate, all scaled by the same factor
    scaler.step(optimizer)  # once per effective batch
    scaler.update()

# The accumulated gradient equals the full batch's (up to float16 rounding).
optimizer.zero_grad()
with mixprec.autocast(device, dtype=torch.float16):
    full = torch.nn.functional.mse_loss(model(x).float(), y)
full.backward()
reference = model.weight.grad.clone()
optimizer.zero_grad()
for xb, yb in zip(x.chunk(ACCUMULATE), y.chunk(ACCUMULATE), strict=True):
    with mixprec.autocast(device, dtype=torch.float16):
        part = torch.nn.functional.mse_loss(model(xb).float(), yb) / ACCUMULATE
    part.backward()
error = (model.weight.grad - reference).norm() / reference.norm()
print(f"loss {full.item():.4f}; accumulated vs full-batch gradient: relative error {error:.1e}")
assert error < 1e-2
