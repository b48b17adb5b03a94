"""The typical mixed-precision training loop (the "Typical use" of the torch.cuda.amp 1.5 docs).

autocast runs the forward pass in float16 (or bfloat16), GradScaler scales the loss so that small
float16 gradients do not flush to zero, unscales them before the optimizer step, skips the step
when they overflowed, and adjusts the scale.

    python examples/typical_loop.py            # MIXPREC_EXAMPLE_STEPS=5 for a quick run
"""

from __future__ import annotations

import os

import torch

import mixprec

STEPS = int(os.environ.get("MIXPREC_EXAMPLE_STEPS", "100"))
device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(0)
x = torch.randn(512, 20, device=device)
labels = (x[:, :5].sum(1) > 0).long()  # a simple binary classification task
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)).to(
    device
)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
loss_fn = torch.nn.CrossEntropyLoss()

# Creates a GradScaler once at the beginning of training.
scaler = mixprec.GradScaler()

for _epoch in range(STEPS):
    for inputs, target in zip(x.split(128), labels.split(128), strict=True):
        optimizer.zero_grad()
        # Runs the forward pass with autocasting (float16 matmuls, float32 where it matters).
        with mixprec.autocast(device, dtype=torch.float16):
            output = model(inputs)
            loss = loss_fn(output, target)
        # Scales the loss, and calls backward() on the scaled loss to create scaled gradients.
        scaler.scale(loss).backward()
        # Unscales the gradients, then calls optimizer.step() unless they contain infs or NaNs.
        scaler.step(optimizer)
        # Updates the scale for the next iteration.
        scaler.update()

with torch.no_grad(), mixprec.autocast(device, dtype=torch.float16):
    accuracy = (model(x).argmax(1) == labels).float().mean().item()
stats = scaler.stats()
print(f"loss {loss.item():.4f}, accuracy {accuracy:.2%}")
print(f"steps taken {stats.steps_taken}, skipped {stats.steps_skipped}, scale {stats.scale:g}")
assert torch.isfinite(loss)
