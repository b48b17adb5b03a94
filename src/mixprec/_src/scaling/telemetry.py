"""What a user reads from a scaler besides the scale: skip flags, counters, history, update hooks,
and the warnings and errors about a collapsing scale.

The value types (:class:`ScalerStats`, :class:`HistoryEntry`, :class:`UpdateEvent`) are public
through :mod:`mixprec.types`; :class:`Telemetry` is the GradScaler's part that keeps them.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from mixprec._src.scaling import diagnostics
from mixprec._src.scaling.rule import Values
from mixprec.errors import ConfigError, ScaleCollapseError, ScaleCollapseWarning


@dataclass(frozen=True)
class ScalerStats:
    """Counters since the scaler was created (or since the state dict it was loaded from).

    Attributes:
        iterations: calls to ``update()`` that applied the rule.
        steps_taken: iterations without an inf/NaN gradient.
        steps_skipped: iterations with one (their optimizer steps were skipped).
        consecutive_skips: skipped iterations in a row, up to the last one.
        growths: times the scale grew.
        backoffs: times the scale shrank.
        scale: the current scale.
    """

    iterations: int
    steps_taken: int
    steps_skipped: int
    consecutive_skips: int
    growths: int
    backoffs: int
    scale: float


@dataclass(frozen=True)
class HistoryEntry:
    """One iteration of the scale history.

    Attributes:
        iteration: 1-based number of the update that ended the iteration.
        scale: the scale used during that iteration (the one its gradients were scaled by).
        skipped: whether the iteration's optimizer steps were skipped.
    """

    iteration: int
    scale: float
    skipped: bool


@dataclass(frozen=True)
class UpdateEvent:
    """What an update hook receives: device tensors, nothing read back to the host.

    Attributes:
        iteration: 1-based number of this update.
        scale: the scale after the update (0-d float32, the scaler's own tensor: do not modify).
        found_inf: the iteration's combined overflow flag (0-d float32, non-zero = overflow).
        skipped: ``found_inf != 0`` (0-d bool).
    """

    iteration: int
    scale: torch.Tensor
    found_inf: torch.Tensor
    skipped: torch.Tensor


class History:
    """A bounded ring of (scale, skipped) kept on the device until read."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._scales: torch.Tensor | None = None
        self._skips: torch.Tensor | None = None
        self._count = 0
        self._first_iteration = 1

    def record(self, iteration: int, scale: torch.Tensor, overflow: torch.Tensor) -> None:
        """Append one iteration (two tiny device copies). Host sync: none."""
        if self.capacity == 0:
            return
        if self._scales is None or self._skips is None:
            self._scales = torch.zeros(self.capacity, dtype=torch.float32, device=scale.device)
            self._skips = torch.zeros(self.capacity, dtype=torch.bool, device=scale.device)
            self._first_iteration = iteration
        slot = self._count % self.capacity
        self._scales[slot].copy_(scale)
        self._skips[slot].copy_(overflow)
        self._count += 1

    def entries(self) -> list[HistoryEntry]:
        """Oldest first. Host sync: one."""
        if self._scales is None or self._skips is None or self._count == 0:
            return []
        n = min(self._count, self.capacity)
        start = self._count - n
        order = [(start + k) % self.capacity for k in range(n)]
        scales = self._scales[order].tolist()
        skips = self._skips[order].tolist()
        first = self._first_iteration + start
        return [HistoryEntry(first + k, scales[k], skips[k]) for k in range(n)]

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        for key in ("_scales", "_skips"):
            tensor = state[key]
            state[key] = tensor.cpu() if isinstance(tensor, torch.Tensor) else None
        return state


def stats_of(values: Values, scale: float | None = None) -> ScalerStats:
    """The counters of ``values`` as a :class:`ScalerStats` (``scale`` overrides the scale).

    Host sync: none.
    """
    iterations, skipped, growths, backoffs = values.counters
    return ScalerStats(
        iterations=iterations,
        steps_taken=iterations - skipped,
        steps_skipped=skipped,
        consecutive_skips=values.overflow_streak,
        growths=growths,
        backoffs=backoffs,
        scale=values.scale if scale is None else scale,
    )


class Telemetry:
    """What users read besides the scale: skip flags, history, update hooks, collapse checks.

    Everything stays on the device until read.
    """

    # An OrderedDict because torch's RemovableHandle keeps a weak reference to it.
    hooks: OrderedDict[int, Callable[[Any, UpdateEvent], None]]

    def __init__(self, history: int) -> None:
        self.history = History(history)
        self.hooks = OrderedDict()
        self._step_skips: dict[int, torch.Tensor] = {}  # non-zero: skipped (compared when read)
        self._last_iteration: torch.Tensor | None = None
        self._warned: set[str] = set()

    def wants_events(self) -> bool:
        """Whether an update must build an event (hooks or history). Host sync: none."""
        return bool(self.hooks) or self.history.capacity > 0

    def register(self, hook: Callable[[Any, UpdateEvent], None]) -> RemovableHandle:
        """Call ``hook(scaler, event)`` after every rule update. Host sync: none."""
        if not callable(hook):
            raise ConfigError(f"hook must be callable, got {type(hook).__name__}.")
        handle = RemovableHandle(self.hooks)
        self.hooks[handle.id] = hook
        return handle

    def note_step(self, optimizer: object, found_inf: torch.Tensor) -> None:
        """Remember ``optimizer``'s overflow flag (non-zero: skipped). Host sync: none."""
        self._step_skips[id(optimizer)] = found_inf

    def skip_flag(
        self, optimizer: object | None, stepped: list[torch.optim.Optimizer]
    ) -> torch.Tensor | None:
        """The skip flag of ``optimizer`` (or of this iteration's ``stepped`` optimizers, else
        of the last iteration), or None when there is none. Host sync: none."""
        if optimizer is not None:
            flag = self._step_skips.get(id(optimizer))
        else:
            current = [self._step_skips[id(o)] for o in stepped if id(o) in self._step_skips]
            flag = torch.stack(current).ne(0).any() if current else self._last_iteration
        return None if flag is None else flag != 0

    def after_update(
        self,
        scaler: Any,
        iteration: int,
        scale: torch.Tensor,
        used: torch.Tensor,
        total: Any,
        values: Values | None,
        limit: int | None,
        optimizers: Callable[[], list[torch.optim.Optimizer]],
    ) -> None:
        """Record the iteration (history), call the hooks, then :meth:`watch` the values if
        known. Host sync: none (hooks may; one to name parameters when it warns or raises)."""
        self._last_iteration = total
        if self.wants_events():
            event = UpdateEvent(iteration, scale, total, total != 0)
            self.history.record(iteration, used, event.skipped)
            for hook in list(self.hooks.values()):
                hook(scaler, event)
        if values is not None:
            self.watch(values.scale, values.overflow_streak, limit, optimizers)

    def watch(
        self,
        scale: float,
        streak: int,
        limit: int | None,
        optimizers: Callable[[], list[torch.optim.Optimizer]],
        may_raise: bool = True,
    ) -> None:
        """Warn once when the scale drops below 1 or 50 iterations in a row were skipped; raise
        on ``limit`` (``max_consecutive_skips``), naming the parameters of ``optimizers()``.
        Host sync: one to name the parameters, only when it warns or raises."""
        if limit is None and scale >= 1.0 and streak < SKIP_WARNING:
            return  # the common case, in one test
        if may_raise and limit is not None and streak >= limit:
            what = f"{streak} consecutive iterations overflowed"
            raise ScaleCollapseError(_collapse_text(what, scale, streak, optimizers()))
        if scale < 1.0 and "below_one" not in self._warned:
            self._warned.add("below_one")
            what = "The loss scale fell below 1: gradients are being scaled down, not up"
            _warn(_collapse_text(what, scale, streak, optimizers()))
        if streak >= SKIP_WARNING and "streak" not in self._warned:
            self._warned.add("streak")
            what = f"{streak} consecutive iterations were skipped"
            _warn(_collapse_text(what, scale, streak, optimizers()))

    def __getstate__(self) -> dict[str, Any]:
        # Hooks may be lambdas and the skip flags are keyed by object ids of this process.
        state = dict(self.__dict__)
        state.update(hooks=OrderedDict(), _step_skips={}, _last_iteration=None)
        return state


#: Consecutive skipped iterations after which a warning is emitted (once).
SKIP_WARNING = 50


def _warn(message: str) -> None:
    warnings.warn(message, ScaleCollapseWarning, stacklevel=5)


def _collapse_text(
    what: str, scale: float, streak: int, optimizers: list[torch.optim.Optimizer]
) -> str:
    diagnosis = diagnostics.diagnose_optimizers(optimizers) if optimizers else None
    return diagnostics.collapse_message(what, scale, streak, diagnosis)
