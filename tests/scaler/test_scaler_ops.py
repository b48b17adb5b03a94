"""Ops the scaler dispatches on the fused device path, counted against torch.amp.GradScaler.

A CUDA user with ``fused=True`` optimizers takes the device path, where nothing is read back to
the host. It runs here on the CPU with the CPU's row of the device table replaced by CUDA's
(``tests/scaler_paths.py``), and every op that reaches the dispatcher is counted with a
``TorchDispatchMode`` (``docs/internals.md``), for mixprec and for torch's scaler doing the same
work: ``update()`` is torch's kernel, plus the floor clamp once the host cannot rule the floor out,
plus one op in 256 updates that stacks the logged flags; ``step`` + ``update`` never dispatch more
than torch's.
"""

from __future__ import annotations

from typing import Any

import torch
from tests.scaler_paths import device_path
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _run(
    scaler: Any, overflows: set[int], steps: int, read: bool
) -> list[tuple[list, list, float]]:
    """``(step ops, update ops, scale after)`` of each iteration of a small fused-AdamW run."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(2, 4)
    out = []
    for it in range(steps):
        opt.zero_grad()
        scaler.scale(model(x).pow(2).sum()).backward()
        if it in overflows:
            with torch.no_grad():
                model.weight.grad[0, 0] = float("inf")
        with _Ops() as step:
            scaler.step(opt)
        with _Ops() as update:
            scaler.update()
        scale = scaler.get_scale() if read or it == steps - 1 else float("nan")
        out.append((step.names, update.names, scale))
    return out


def test_update_is_torchs_kernel_and_step_update_cost_no_more_than_torch() -> None:
    """Iterations that read the scale between them (a logging loop): clean, backoff, growth."""
    settings = {"init_scale": 2.0**10, "growth_interval": 3}
    overflows, steps = {4, 9}, 16
    theirs = _run(torch.amp.GradScaler("cpu", **settings), overflows, steps, read=True)
    with device_path():
        ours = _run(mixprec.GradScaler("cpu", **settings), overflows, steps, read=True)
    changed = 0
    for it in range(1, steps):  # (the first step creates the optimizer's state)
        (step, update, scale), (t_step, t_update, t_scale) = ours[it], theirs[it]
        assert scale == t_scale, it
        assert update == ["_amp_update_scale_"], (it, update)
        assert len(step) + len(update) <= len(t_step) + len(t_update), (it, step, t_step)
        changed += scale != ours[it - 1][2]
    assert changed >= 4  # backoffs and growths among the iterations counted


def test_a_long_run_without_reads_stays_within_torchs_ops() -> None:
    """No read for 300 updates: the host can no longer rule the floor out (the clamp joins the
    kernel) and the logged flags are stacked once in 256 updates; the state read at the end is
    torch's."""
    settings = {"init_scale": 2.0**16, "growth_interval": 50}
    overflows, steps = set(range(3, 300, 7)), 300
    theirs = _run(torch.amp.GradScaler("cpu", **settings), overflows, steps, read=False)
    with device_path():
        scaler = mixprec.GradScaler("cpu", **settings)
        ours = _run(scaler, overflows, steps, read=False)
        stats = scaler.stats()
    counts = [len(update) for _, update, _ in ours[1:]]
    assert max(counts) <= 2, counts
    extra = {"_to_copy", "_local_scalar_dense", "stack"}  # a probe sent, read; flags stacked
    assert {n for _, update, _ in ours for n in update} <= {"_amp_update_scale_", *extra}
    for (step, update, _), (t_step, t_update, _) in zip(ours[1:], theirs[1:], strict=True):
        assert len(step) + len(update) <= len(t_step) + len(t_update), (step, t_step)
    assert ours[-1][2] == theirs[-1][2]
    assert (stats.iterations, stats.steps_skipped) == (steps, len(overflows))
