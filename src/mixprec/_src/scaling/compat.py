"""torch.amp.GradScaler's private methods that other code calls, on the one GradScaler class.

accelerate calls ``_lazy_init_scale_growth_tracker``; optimizers written to torch's legacy fused
contract (``step(closure=None, grad_scaler=None)``) call ``_check_inf_per_device`` and
``_get_scale_async``; tests and tools read ``_get_growth_tracker``, ``_scale`` and
``_growth_tracker``. They are bound into :class:`~mixprec.GradScaler` under torch's names and
reach the scaler only through its internal interface
(:func:`~mixprec._src.scaling.engine.engine_of`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mixprec._src.scaling.engine import engine_of

if TYPE_CHECKING:
    from mixprec._src.scaling.grad_scaler import GradScaler

_Optimizer = torch.optim.Optimizer


def lazy_init_scale_growth_tracker(self: GradScaler, dev: torch.device | str) -> None:
    """Create the scale tensors on ``dev`` now (used by accelerate). Host sync: none."""
    engine_of(self).state.materialize(torch.device(dev))


def get_scale_async(self: GradScaler) -> torch.Tensor | None:
    """The scale tensor, or None before the first ``scale()``. Host sync: none."""
    return engine_of(self).state.scale


def get_growth_tracker(self: GradScaler) -> int:
    """Clean iterations since the last growth or overflow. Host sync: as get_scale."""
    return engine_of(self).state.values().growth_tracker if self.is_enabled() else 0


def growth_tracker_tensor(self: GradScaler) -> torch.Tensor | None:
    """The growth tracker tensor, or None before the first ``scale()``. Host sync: none."""
    return engine_of(self).state.growth_tracker()


def check_inf_per_device(
    self: GradScaler, optimizer: _Optimizer
) -> dict[torch.device, torch.Tensor]:
    """Check the grads without unscaling them (torch's legacy fused contract calls it from
    ``optimizer.step(grad_scaler=...)``). Host sync: none."""
    engine = engine_of(self)
    engine.require_scale("_check_inf_per_device")
    record = engine.phases.get(optimizer)
    engine.check(optimizer, record)
    return record.found_inf_per_device


def found_inf_per_device(
    self: GradScaler, optimizer: _Optimizer
) -> dict[torch.device, torch.Tensor]:
    """The flags recorded for ``optimizer`` this iteration. Host sync: none."""
    return engine_of(self).phases.get(optimizer).found_inf_per_device
