"""Gradient penalty: a loss term built from the gradients themselves.

``torch.autograd.grad`` of the *scaled* loss returns scaled gradients; unscale them yourself
(multiply by ``1 / scaler.get_scale()``) before computing the penalty, and compute the penalty
inside autocast. The final backward uses ``scaler.scale`` as usual. If the penalty's gradients
overflow, ``step`` skips the update like any other.

    python examples/gradient_penalty.py        # MIXPREC_EXAMPLE_STEPS=5 for a quick run
"""

from __future__ import annotations

import os

import torch

import mixprec

STEPS = int(os.environ.get("MIXPREC_EXAMPLE_STEPS", "50"))
device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(
    device
)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
scaler = mixprec.GradScaler()
x = torch.randn(128, 8, device=device)
y = torch.sin(x[:, :1])

for _ in range(STEPS):
    optimizer.zero_grad()
    with mixprec.autocast(device, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)

    # Scaled gradients of the loss w.r.t. the parameters, kept in the graph (create_graph).
    params = list(model.parameters())
    scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    grads = [g * inv_scale for g in scaled_grads]  # unscaled; not the .grad attributes

    with mixprec.autocast(device, dtype=torch.float16):
        penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        total = loss + 0.1 * penalty

    scaler.scale(total).backward()
    scaler.step(optimizer)
    scaler.update()

print(f"loss {loss.item():.4f}, gradient penalty {penalty.item():.4f}")
assert torch.isfinite(total)
