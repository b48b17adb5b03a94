"""An LR scheduler and an EMA of the weights that advance only on real updates.

When the gradients overflow, ``scaler.step`` skips ``optimizer.step()``. A loop that still steps
its LR scheduler and its exponential moving average of the weights lets them run ahead of the
updates actually made (and torch warns when the very first step is skipped). Ask the scaler:
``scaler.last_step_skipped()`` (one host sync; ``last_step_skipped_async()`` returns a device
tensor instead). ``mixprec.integrations.SkipAwareScheduler`` wraps a scheduler to do this for you.

Here one iteration's gradients are made to overflow on purpose, to show the skip.

    python examples/scheduler_ema.py           # MIXPREC_EXAMPLE_STEPS=8 for a quick run
"""

from __future__ import annotations

import copy
import math
import os

import torch

import mixprec

STEPS = int(os.environ.get("MIXPREC_EXAMPLE_STEPS", "60"))
OVERFLOW_AT = 3  # this iteration's gradients get an inf
device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(0)
model = torch.nn.Linear(16, 1).to(device)
ema_model = copy.deepcopy(model).requires_grad_(False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: min(1.0, (n + 1) / 10))
scaler = mixprec.GradScaler()
x = torch.randn(128, 16, device=device)
y = x.sum(1, keepdim=True) / 4


@torch.no_grad()
def update_ema(decay: float = 0.9) -> None:
    for ema_p, p in zip(ema_model.parameters(), model.parameters(), strict=True):
        ema_p.lerp_(p, 1 - decay)


updates = 0
for step in range(STEPS):
    optimizer.zero_grad()
    with mixprec.autocast(device, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    if step == OVERFLOW_AT:
        model.weight.grad[0, 0] = math.inf  # as if the float16 backward had overflowed
    scaler.step(optimizer)
    scaler.update()
    if scaler.last_step_skipped():
        print(f"step {step}: skipped (inf/NaN gradient); scheduler and EMA left alone")
        continue
    scheduler.step()
    update_ema()
    updates += 1

skipped = scaler.stats().steps_skipped
print(f"{updates} updates, {skipped} skipped; scheduler epochs {scheduler.last_epoch}")
print(f"loss {loss.item():.4f}, lr {scheduler.get_last_lr()[0]:.3f}")
assert skipped >= 1 and scheduler.last_epoch == updates == STEPS - skipped
