"""Signals a user reads from a scaler: skip flags, counters, history, hooks, collapse checks."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

from mixprec._src.scaling import diagnostics
from mixprec._src.scaling.core import ScalerCore
from mixprec._src.scaling.phases import OptimizerRecord
from mixprec._src.scaling.rule import ScaleState
from mixprec._src.scaling.telemetry import HistoryEntry, ScalerStats, UpdateEvent, read_stats
from mixprec.errors import ConfigError, ScaleCollapseError, ScaleCollapseWarning, ScalerStateError

_Optimizer = torch.optim.Optimizer

#: Consecutive skipped iterations after which a warning is emitted (once).
_SKIP_WARNING = 50


def _warn(message: str) -> None:
    warnings.warn(message, ScaleCollapseWarning, stacklevel=5)


class ScalerSignals(ScalerCore):
    """Skip signal, telemetry and collapse detection (see :class:`GradScaler`)."""

    def _watch(self, state: ScaleState, records: list[OptimizerRecord]) -> None:
        """Warn once when the scale drops below 1 or 50 iterations in a row were skipped;
        raise on ``max_consecutive_skips``. Uses the host mirror, so it syncs only when the
        mirror is unknown and ``max_consecutive_skips`` is set."""
        limit = self._config.max_consecutive_skips
        exact = self._mirror.exact
        if exact is None and limit is not None:
            exact = self._mirror.resync(state)
        if exact is not None:
            self._check_collapse(exact.scale, exact.overflow_streak, records)

    def _check_collapse(
        self, scale: float, streak: int, records: list[OptimizerRecord], may_raise: bool = True
    ) -> None:
        limit = self._config.max_consecutive_skips
        if may_raise and limit is not None and streak >= limit:
            what = f"{streak} consecutive iterations overflowed"
            raise ScaleCollapseError(self._collapse_text(what, scale, streak, records))
        if scale < 1.0 and "below_one" not in self._warned:
            self._warned.add("below_one")
            what = "The loss scale fell below 1: gradients are being scaled down, not up"
            _warn(self._collapse_text(what, scale, streak, records))
        if streak >= _SKIP_WARNING and "streak" not in self._warned:
            self._warned.add("streak")
            what = f"{streak} consecutive iterations were skipped"
            _warn(self._collapse_text(what, scale, streak, records))

    def _collapse_text(
        self, what: str, scale: float, streak: int, records: list[OptimizerRecord]
    ) -> str:
        optimizers = [r.optimizer() for r in records if r.optimizer is not None]
        alive = [o for o in optimizers if o is not None]
        diagnosis = diagnostics.diagnose_optimizers(alive) if alive else None
        return diagnostics.collapse_message(what, scale, streak, diagnosis)

    # ------------------------------------------------------------------ telemetry

    def last_step_skipped(self, optimizer: _Optimizer | None = None) -> bool:
        """Whether the last ``step`` of ``optimizer`` was skipped (any optimizer of the
        current or, after ``update()``, the last iteration when ``optimizer`` is None).

        Correct for fused optimizers too, whose ``step`` is always called. Use it to advance
        LR schedulers, EMAs and step counters only on real updates. ``False`` when disabled.

        Raises:
            ScalerStateError: that optimizer (or any) has not been stepped yet.

        Host sync: one (use :meth:`last_step_skipped_async` to avoid it).
        """
        return bool(self.last_step_skipped_async(optimizer).item())

    def last_step_skipped_async(self, optimizer: _Optimizer | None = None) -> torch.Tensor:
        """:meth:`last_step_skipped` as a 0-d bool tensor on the scale's device.

        Host sync: none.
        """
        if not self._enabled:
            return torch.zeros((), dtype=torch.bool)
        if optimizer is not None:
            flag = self._step_skips.get(id(optimizer))
        else:
            current = [self._step_skips[id(o)] for o in self._stepped_this_iteration()]
            flag = torch.stack(current).ne(0).any() if current else self._last_iteration_skip
        if flag is None:
            raise ScalerStateError(
                "last_step_skipped() was called before any scaler.step() of "
                + ("this optimizer." if optimizer is not None else "any optimizer.")
            )
        return flag != 0

    def _stepped_this_iteration(self) -> list[_Optimizer]:
        refs = [r.optimizer for r in self._phases.records() if r.optimizer is not None]
        return [o for o in (ref() for ref in refs) if o is not None]

    def stats(self) -> ScalerStats:
        """Counters since creation (or since the loaded state dict) and the current scale.

        Emits the collapse warnings (:meth:`update` does where the host follows the scale).

        Host sync: one, when the scale lives on an accelerator (the counters stay on the
        device until read).
        """
        if not self._enabled or self._state is None:
            p = self._pending
            it, skipped = p.counters[0], p.counters[1]
            scale = p.scale if self._enabled else 1.0
            return ScalerStats(
                iterations=it,
                steps_taken=it - skipped,
                steps_skipped=skipped,
                consecutive_skips=p.overflow_streak,
                growths=p.counters[2],
                backoffs=p.counters[3],
                scale=scale,
            )
        stats = read_stats(self._state)
        # Where the host could not follow the scale (fused optimizers off the CPU), this read is
        # the first chance to notice a collapse.
        self._check_collapse(stats.scale, stats.consecutive_skips, [], may_raise=False)
        return stats

    def history(self) -> list[HistoryEntry]:
        """The last ``history`` iterations (constructor argument), oldest first.

        Host sync: one.
        """
        return self._history.entries()

    def register_update_hook(
        self, hook: Callable[[ScalerSignals, UpdateEvent], None]
    ) -> RemovableHandle:
        """Call ``hook(scaler, event)`` after every rule update (not after ``update(new_scale)``).

        The event holds device tensors; the hook decides whether to read them.

        Returns:
            A handle whose ``remove()`` unregisters the hook.

        Host sync: none (unless the hook reads the tensors).
        """
        if not callable(hook):
            raise ConfigError(f"hook must be callable, got {type(hook).__name__}.")
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def diagnose(self, optimizer: _Optimizer | None = None) -> diagnostics.Diagnosis:
        """Parameters of ``optimizer`` (default: those stepped or unscaled this iteration)
        whose grads are inf/NaN or missing, by name when the optimizer knows names.

        Host sync: one.
        """
        if optimizer is not None:
            return diagnostics.diagnose_optimizers([optimizer])
        return diagnostics.diagnose_optimizers(self._stepped_this_iteration())
