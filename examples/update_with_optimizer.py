"""Three training loops that call ``scaler.update(optimizer)``.

Some pages on ``GradScaler.update`` write ``scaler.update(optimizer)``, a form torch.cuda.amp
never accepted. mixprec accepts it: it is ``update()`` after checking that this optimizer was
stepped (or unscaled) in this iteration. Those pages used ``torch.cuda.amp``; here the imports
change to mixprec, and the loops run on the CPU as well (real float16 autocast).

    python examples/update_with_optimizer.py
"""

from __future__ import annotations

import torch

import mixprec

device = "cuda" if torch.cuda.is_available() else "cpu"


def example_update_after_one_step() -> None:
    """Example 1: one step, then ``scaler.update(optimizer)``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = mixprec.GradScaler()
    data = torch.randn(5, 10, device=device)
    target = torch.randn(5, 1, device=device)
    with mixprec.autocast():  # no device: the 1.5 call form, float16
        output = model(data)
        loss = torch.nn.functional.mse_loss(output, target)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update(optimizer)
    print("Scale update done")


def example_training_loop() -> None:
    """Example 2: a loop over epochs with ``scaler.update(optimizer)``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    scaler = mixprec.GradScaler()
    data = torch.randn(20, 10, device=device)
    target = torch.randn(20, 1, device=device)
    for epoch in range(3):
        optimizer.zero_grad()
        with mixprec.autocast():  # no device: the 1.5 call form, float16
            output = model(data)
            loss = torch.nn.functional.mse_loss(output, target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update(optimizer)
        print(f"Epoch {epoch + 1}: loss = {loss.item():.4f}")


def example_update_without_optimizer() -> None:
    """Example 3: ``scaler.update()`` with no argument, as in torch."""
    torch.manual_seed(0)
    scaler = mixprec.GradScaler()
    model = torch.nn.Linear(5, 3).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(4, 5, device=device)
    target = torch.randn(4, 3, device=device)
    with mixprec.autocast():  # no device: the 1.5 call form, float16
        output = model(data)
        loss = torch.nn.functional.mse_loss(output, target)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    print("Update done without an optimizer")


if __name__ == "__main__":
    example_update_after_one_step()
    example_training_loop()
    example_update_without_optimizer()
