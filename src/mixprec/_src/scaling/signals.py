"""GradScaler's signal methods: was the step skipped, counters, history, hooks, diagnosis.

Methods of the one :class:`~mixprec.GradScaler` class, defined here and bound into it by name;
they reach the scaler only through its internal interface
(:func:`~mixprec._src.scaling.engine.engine_of`). The values they return live in
:mod:`.telemetry`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.utils.hooks import RemovableHandle

from mixprec._src.scaling import diagnostics
from mixprec._src.scaling.engine import engine_of
from mixprec._src.scaling.telemetry import HistoryEntry, ScalerStats, UpdateEvent, stats_of

if TYPE_CHECKING:
    from mixprec._src.scaling.grad_scaler import GradScaler

_Optimizer = torch.optim.Optimizer


def last_step_skipped(self: GradScaler, optimizer: _Optimizer | None = None) -> bool:
    """Whether the last ``step`` of ``optimizer`` was skipped (any optimizer of the current
    or, after ``update()``, the last iteration when ``optimizer`` is None).

    Right for fused optimizers too, whose ``step`` is always called: use it to advance LR
    schedulers and EMAs only on real updates. ``False`` when disabled.

    Raises:
        ScalerStateError: that optimizer (or any) has not been stepped yet.

    Host sync: one (use :meth:`last_step_skipped_async` to avoid it).
    """
    return bool(self.last_step_skipped_async(optimizer).item())


def last_step_skipped_async(self: GradScaler, optimizer: _Optimizer | None = None) -> torch.Tensor:
    """:meth:`last_step_skipped` as a 0-d bool tensor on the scale's device.

    Host sync: none.
    """
    if not self.is_enabled():
        return torch.zeros((), dtype=torch.bool)
    engine = engine_of(self)
    flag = engine.telemetry.skip_flag(optimizer, engine.phases.stepped())
    engine.phases.require_step_seen(flag, optimizer)
    assert flag is not None
    return flag


def stats(self: GradScaler) -> ScalerStats:
    """Counters since creation (or since the loaded state dict) and the current scale.

    Emits the collapse warnings where ``update()`` could not (the host did not follow the
    scale: fused optimizers off the CPU).

    Host sync: one, when the scale lives on an accelerator and the host lost track of it.
    """
    state, telemetry = engine_of(self).state, engine_of(self).telemetry
    if not self.is_enabled():
        return stats_of(state.values(), scale=1.0)
    seen = not state.read_pending
    stats = stats_of(state.values())
    if not seen:
        telemetry.watch(stats.scale, stats.consecutive_skips, None, list, may_raise=False)
    return stats


def history(self: GradScaler) -> list[HistoryEntry]:
    """The last ``history`` iterations (constructor argument), oldest first.

    Host sync: one.
    """
    return engine_of(self).telemetry.history.entries()


def register_update_hook(
    self: GradScaler, hook: Callable[[GradScaler, UpdateEvent], None]
) -> RemovableHandle:
    """Call ``hook(scaler, event)`` after every rule update (not after ``update(new_scale)``).

    The event holds device tensors; the hook decides whether to read them.

    Returns:
        A handle whose ``remove()`` unregisters the hook.

    Host sync: none (unless the hook reads the tensors).
    """
    return engine_of(self).telemetry.register(hook)


def diagnose(self: GradScaler, optimizer: _Optimizer | None = None) -> diagnostics.Diagnosis:
    """Parameters of ``optimizer`` (default: those stepped or unscaled this iteration)
    whose grads are inf/NaN or missing, by name when the optimizer knows names.

    Host sync: one.
    """
    optimizers = [optimizer] if optimizer is not None else engine_of(self).phases.stepped()
    return diagnostics.diagnose_optimizers(optimizers)
