"""What a user reads from a scaler besides the scale: skip flags, counters, history, update hooks,
the warnings and errors about a collapsing scale, the diagnosis of bad gradients. The value types
are public through :mod:`mixprec.types` (``docs/api.md``, ``docs/telemetry.md``)."""

from __future__ import annotations

import array
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from mixprec._src import torch_compat
from mixprec._src.kernels.plan import iter_params
from mixprec._src.scaling.rule import Values
from mixprec.errors import ConfigError, ScaleCollapseError, ScaleCollapseWarning


@dataclass(frozen=True)
class ScalerStats:
    """Counters since the scaler was created (or since the state dict it was loaded from)."""

    iterations: int  # calls to update() that applied the rule
    steps_taken: int  # iterations without an inf/NaN gradient
    steps_skipped: int  # iterations with one (their optimizer steps were skipped)
    consecutive_skips: int  # skipped iterations in a row, up to the last one
    growths: int
    backoffs: int
    scale: float


@dataclass(frozen=True)
class HistoryEntry:
    """One iteration of the scale history."""

    iteration: int  # 1-based number of the update that ended the iteration
    scale: float  # the scale its gradients were scaled by
    skipped: bool


@dataclass(frozen=True)
class UpdateEvent:
    """What an update hook receives: device tensors, nothing read back to the host."""

    iteration: int  # 1-based number of this update
    scale: torch.Tensor  # after the update (the scaler's own 0-d float32 tensor: do not modify)
    found_inf: torch.Tensor  # the iteration's combined flag (0-d float32, non-zero = overflow)
    skipped: torch.Tensor  # found_inf != 0 (0-d bool)


class History:
    """The scale each of the last ``capacity`` iterations used and whether it was skipped, in
    host memory, told of each update once the state knows it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._scales = array.array("f", bytes(4 * capacity))  # float32, as the scale is
        self._skips = bytearray(capacity)
        self._count = 0
        self._first = 1

    def record(self, iteration: int, scale: float, skipped: bool) -> None:
        if not self._count:
            self._first = iteration
        slot = self._count % self.capacity
        self._scales[slot], self._skips[slot] = scale, skipped
        self._count += 1

    def entries(self) -> list[HistoryEntry]:
        n = min(self._count, self.capacity)
        slots = [(self._count - n + k) % self.capacity for k in range(n)]
        first = self._first + self._count - n
        return [
            HistoryEntry(first + k, self._scales[i], bool(self._skips[i]))
            for k, i in enumerate(slots)
        ]


class Telemetry:
    """The GradScaler's part that keeps skip flags, history and hooks and watches for a collapse;
    flags stay on the device until read."""

    # An OrderedDict because torch's RemovableHandle keeps a weak reference to it.
    hooks: OrderedDict[int, Callable[[Any, UpdateEvent], None]]

    def __init__(self, history: int) -> None:
        self.history = History(history)
        self.hooks = OrderedDict()
        self._step_skips: dict[int, torch.Tensor] = {}  # non-zero: skipped (compared when read)
        self._last_iteration: torch.Tensor | None = None
        self._warned: set[str] = set()

    def stats(self, values: Values, unseen: bool, enabled: bool) -> ScalerStats:
        """The scaler's :class:`ScalerStats`, with the collapse warnings that ``update()`` could
        not emit when the host did not know the values (``unseen``)."""
        n, skipped, growths, backoffs = values.counters
        streak, scale = values.overflow_streak, values.scale if enabled else 1.0
        if enabled and unseen:
            self.watch(scale, streak, None, list, may_raise=False)
        return ScalerStats(n, n - skipped, skipped, streak, growths, backoffs, scale)

    def register(self, hook: Callable[[Any, UpdateEvent], None]) -> RemovableHandle:
        if not callable(hook):
            raise ConfigError(f"hook must be callable, got {type(hook).__name__}.")
        handle = RemovableHandle(self.hooks)
        self.hooks[handle.id] = hook
        return handle

    def note_step(self, optimizer: object, found_inf: torch.Tensor) -> None:
        self._step_skips[id(optimizer)] = found_inf

    def skip_flag(
        self, optimizer: object | None, stepped: list[torch.optim.Optimizer]
    ) -> torch.Tensor | None:
        """The skip flag of ``optimizer`` (or of this iteration's ``stepped`` optimizers, else
        of the last iteration), or None when there is none."""
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
        scale: Any,
        total: Any,
        values: Values | None,
        limit: int | None,
        optimizers: Callable[[], list[torch.optim.Optimizer]],
    ) -> None:
        """Call the hooks, then :meth:`watch` the values if known."""
        self._last_iteration = total
        if self.hooks:
            event = UpdateEvent(iteration, scale, total, total != 0)
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
            raise ScaleCollapseError(_collapse_message(what, scale, streak, optimizers()))
        if scale < 1.0 and "below_one" not in self._warned:
            self._warned.add("below_one")
            what = "The loss scale fell below 1: gradients are being scaled down, not up"
            _warn(_collapse_message(what, scale, streak, optimizers()))
        if streak >= SKIP_WARNING and "streak" not in self._warned:
            self._warned.add("streak")
            what = f"{streak} consecutive iterations were skipped"
            _warn(_collapse_message(what, scale, streak, optimizers()))

    def __getstate__(self) -> dict[str, Any]:
        # Hooks may be lambdas and the skip flags are keyed by object ids of this process.
        state = dict(self.__dict__)
        state.update(hooks=OrderedDict(), _step_skips={}, _last_iteration=None)
        return state


_MAX_NAMED = 8  # non-finite parameters named in a collapse message
SKIP_WARNING = 50  # consecutive skipped iterations that warn (once)


def _warn(message: str) -> None:
    warnings.warn(message, ScaleCollapseWarning, stacklevel=5)


@dataclass(frozen=True)
class Diagnosis:
    """Parameters (names, else positions) whose gradients are non-finite or missing."""

    non_finite: list[str]
    missing: list[str]

    @property
    def healthy(self) -> bool:
        """True when every parameter has a finite grad."""
        return not self.non_finite and not self.missing

    def __str__(self) -> str:
        if self.healthy:
            return "All gradients are present and finite."
        lines = []
        if self.non_finite:
            lines.append(f"{len(self.non_finite)} parameter(s) with inf/NaN gradients:")
            lines.extend(f"  - {name}" for name in self.non_finite)
        if self.missing:
            lines.append(f"{len(self.missing)} parameter(s) without a gradient:")
            lines.extend(f"  - {name}" for name in self.missing)
        return "\n".join(lines)


def diagnose_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> Diagnosis:
    """Check every grad of ``optimizers`` (one host sync for all of them)."""
    refs, flags, missing = [], [], []
    for optimizer in optimizers:
        for ref in iter_params(optimizer):
            grad = ref.param.grad
            if grad is None:
                missing.append(ref.describe())
                continue
            values = torch_compat.sparse_values(grad) if grad.is_sparse else grad
            refs.append(ref)
            flags.append(torch.isfinite(values).all().to("cpu", non_blocking=True))
    finite = torch.stack(flags).tolist() if flags else []
    bad = [ref.describe() for ref, ok in zip(refs, finite, strict=True) if not ok]
    return Diagnosis(non_finite=bad, missing=missing)


def _collapse_message(
    what: str, scale: float, skips: int, optimizers: list[torch.optim.Optimizer]
) -> str:
    """Why training stopped making progress, and what usually causes it."""
    diagnosis = diagnose_optimizers(optimizers) if optimizers else None
    offenders = "The parameters could not be inspected (their optimizers are gone)."
    if diagnosis is not None and diagnosis.non_finite:
        offenders = (
            f"Non-finite gradients now: {', '.join(diagnosis.non_finite[:_MAX_NAMED])}"
            + (" ..." if len(diagnosis.non_finite) > _MAX_NAMED else "")
            + "."
        )
    elif diagnosis is not None:
        offenders = "No parameter holds a non-finite gradient right now."
    return (
        f"{what} (scale {scale:g}, {skips} consecutive skipped iteration(s)). {offenders} "
        "Likely causes: an fp16 overflow in the forward pass (a loss or activation beyond "
        "65504: look for the first non-finite module output, or run that module in fp32), a "
        "model pretrained in bf16 whose values do not fit fp16 (train in bfloat16 instead), or "
        "a learning rate that makes training diverge (lower it, or clip gradients)."
    )
