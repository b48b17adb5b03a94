"""Gradient clipping: unscale first, then clip, then step.

Clipping must see the true (unscaled) gradients. ``scaler.unscale_(optimizer)`` unscales them in
place; ``scaler.step`` then knows they are unscaled and does not unscale them twice. If they
contain inf/NaN, ``clip_grad_norm_`` returns a non-finite norm and ``step`` skips the update.

    python examples/clipping.py                # MIXPREC_EXAMPLE_STEPS=5 for a quick run
"""

from __future__ import annotations

import os

import torch

import mixprec

STEPS = int(os.environ.get("MIXPREC_EXAMPLE_STEPS", "50"))
MAX_NORM = 1.0
device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(
    device
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = mixprec.GradScaler()
x = torch.randn(256, 16, device=device)
y = 10 * x[:, :1]  # large targets: large gradients, so clipping is active

norms = []
for _ in range(STEPS):
    optimizer.zero_grad()
    with mixprec.autocast(device, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # the grads are now unscaled, in place
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    norms.append(norm.item())
    scaler.step(optimizer)  # does not unscale again; skips if the grads had inf/NaN
    scaler.update()
    if not scaler.last_step_skipped():
        clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        assert clipped <= MAX_NORM * 1.001, clipped

print(f"gradient norm before clipping: first {norms[0]:.1f}, last {norms[-1]:.1f}")
print(f"loss {loss.item():.3f}, scale {scaler.get_scale():g}")
