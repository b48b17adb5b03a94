"""The seed documents' examples, with mixprec in place of torch.cuda.amp, scale for real on the CPU.

The code below is the seeds' code with two substitutions: ``from torch.cuda.amp import
GradScaler`` becomes ``from mixprec import GradScaler``, and ``torch.cuda.amp.autocast()`` becomes
``torch.autocast("cpu", dtype=torch.float16)`` (real fp16 compute on the CPU). On a CPU-only machine
torch's own versions silently disable themselves; these must not.
"""

from __future__ import annotations

import torch

from mixprec import GradScaler


def _scaled_grad_magnitude(model: torch.nn.Module) -> float:
    return max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)


def test_seed_typical_use() -> None:
    """seeds/000: the 'Typical use' loop."""
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.MSELoss()
    data = [(torch.randn(5, 10), torch.randn(5, 1)) for _ in range(4)]
    scaler = GradScaler()
    for _epoch in range(2):
        for input, target in data:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                output = model(input)
                assert output.dtype == torch.float16
            loss = loss_fn(output.float(), target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    stats = scaler.stats()  # fp16 overflows at the start calibrate the scale down
    assert stats.iterations == 8 and stats.steps_taken >= 4
    assert scaler.get_scale() == 65536.0 * 0.5**stats.steps_skipped


def test_seed_update_with_optimizer_example_1() -> None:
    """seeds/001, first example: one iteration ending in ``scaler.update(optimizer)``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler()
    data = torch.randn(5, 10)
    target = torch.randn(5, 1)
    with torch.autocast("cpu", dtype=torch.float16):
        output = model(data)
        loss = torch.nn.functional.mse_loss(output, target)
    scaler.scale(loss).backward()
    assert _scaled_grad_magnitude(model) > 1000  # the grads were really scaled
    before = model.weight.detach().clone()
    scaler.step(optimizer)
    scaler.update(optimizer)
    assert not torch.equal(before, model.weight)  # and unscaled before the (real) step
    assert _scaled_grad_magnitude(model) < 100


def test_seed_update_with_optimizer_example_2_tracks_fp32() -> None:
    """seeds/001, second example: three epochs with Adam; losses close to an fp32 run."""

    def train(mixed: bool) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Linear(10, 1)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
        scaler = GradScaler(enabled=mixed)
        data = torch.randn(20, 10)
        target = torch.randn(20, 1)
        losses = []
        for _epoch in range(3):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=mixed):
                output = model(data)
                loss = torch.nn.functional.mse_loss(output, target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update(optimizer)
            losses.append(loss.item())
        return losses

    mixed, full = train(True), train(False)
    assert all(abs(a - b) < 1e-2 for a, b in zip(mixed, full, strict=True))
    assert mixed[-1] < mixed[0]


def test_seed_update_without_optimizer_example_3() -> None:
    """seeds/001, third example: ``scaler.update()`` with no argument."""
    torch.manual_seed(0)
    scaler = GradScaler()
    model = torch.nn.Linear(5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(4, 5)
    target = torch.randn(4, 3)
    with torch.autocast("cpu", dtype=torch.float16):
        output = model(data)
        loss = torch.nn.functional.mse_loss(output, target)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.stats().iterations == 1 and not scaler.last_step_skipped()
