"""Update hooks that log the scaler: the shared windowing, and the plain-``logging`` hook.

Every hook counts skips on the device and reads them back once every ``every_n`` updates.
:class:`MetricsHook` feeds any ``log(metrics, step=...)`` function (Lightning loggers, accelerate,
wandb); :mod:`mixprec.integrations.tensorboard` has the TensorBoard one.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import Any

import torch

from mixprec._src.scaling.grad_scaler import GradScaler
from mixprec._src.scaling.telemetry import UpdateEvent
from mixprec.errors import ConfigError

__all__ = ["LoggingHook", "MetricsHook", "UpdateRecord", "WindowedUpdateHook"]


@dataclass(frozen=True)
class UpdateRecord:
    """What a logging hook writes, read back to the host once per window.

    Attributes:
        iteration: the scaler's update count (1-based), used as the logging step.
        scale: the scale after this update.
        skipped: skipped iterations in the window (the last ``every_n`` updates).
        skipped_total: skipped iterations since the hook was attached.
        window: updates in the window (``every_n``, or fewer for the last one flushed).
        grad_norm: the last norm passed to ``record_grad_norm`` in the window, or None.
    """

    iteration: int
    scale: float
    skipped: int
    skipped_total: int
    window: int
    grad_norm: float | None


class WindowedUpdateHook(abc.ABC):
    """Base of the update hooks: call ``emit`` every ``every_n`` updates.

    Register it with ``scaler.register_update_hook(hook)`` or ``hook.attach(scaler)``.

    Args:
        every_n: updates per window, an int >= 1. Each window costs one host sync.

    Raises:
        ConfigError: ``every_n`` is not an int >= 1.
    """

    def __init__(self, every_n: int = 1) -> None:
        if isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1:
            raise ConfigError(f"every_n must be an int >= 1, got {every_n!r}.")
        self.every_n = every_n
        self.skipped_total = 0
        self._skips: torch.Tensor | None = None
        self._window = 0
        self._last: UpdateEvent | None = None
        self._grad_norm: torch.Tensor | float | None = None
        self._handle: Any = None

    def attach(self, scaler: GradScaler) -> WindowedUpdateHook:
        """Register this hook on ``scaler``; returns ``self``.

        Host sync: none.
        """
        self.detach()
        self._handle = scaler.register_update_hook(self)
        return self

    def detach(self) -> None:
        """Unregister from the scaler ``attach`` registered on (nothing if not attached).

        Host sync: none.
        """
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def record_grad_norm(self, norm: torch.Tensor | float) -> None:
        """Pass the iteration's gradient norm (e.g. ``clip_grad_norm_``'s result); it is
        written with the next window. Call it before ``scaler.update()``.

        Host sync: none (the tensor is read with the window).
        """
        self._grad_norm = norm.detach() if isinstance(norm, torch.Tensor) else float(norm)

    def __call__(self, scaler: object, event: UpdateEvent) -> None:
        """The update hook. Host sync: one every ``every_n`` updates (two with a grad norm)."""
        flag = event.skipped.to(torch.int64)
        self._skips = flag if self._skips is None else self._skips + flag
        self._window += 1
        self._last = event
        if self._window >= self.every_n:
            self.flush()

    def flush(self) -> None:
        """Emit the current window now, if it holds any update.

        Host sync: one (two with a grad norm).
        """
        if self._last is None or self._skips is None:
            return
        scale, skipped = torch.stack([self._last.scale.double(), self._skips.double()]).tolist()
        norm = self._grad_norm
        self.skipped_total += int(skipped)
        record = UpdateRecord(
            iteration=self._last.iteration,
            scale=scale,
            skipped=int(skipped),
            skipped_total=self.skipped_total,
            window=self._window,
            grad_norm=None if norm is None else float(norm),
        )
        self._skips, self._last, self._grad_norm, self._window = None, None, None, 0
        self.emit(record)

    @abc.abstractmethod
    def emit(self, record: UpdateRecord) -> None:
        """Write one record; subclasses implement it. Host sync: none."""


class LoggingHook(WindowedUpdateHook):
    """Log the scale and the skipped iterations every ``every_n`` updates.

    A line reads ``mixprec: iteration 200: scale 32768, 1 of the last 100 steps skipped (3 in
    total), grad norm 0.82``. A window in which every step was skipped is logged at
    ``all_skipped_level`` (WARNING by default), so a collapsing scale stands out.

    Args:
        logger: the logger (default: ``logging.getLogger("mixprec")``).
        every_n: updates per line (each line is one host sync).
        level: level of ordinary lines.
        all_skipped_level: level of a line whose whole window was skipped.

    Raises:
        ConfigError: ``every_n`` is not an int >= 1.

    Example:
        >>> import torch, mixprec
        >>> from mixprec.integrations import LoggingHook
        >>> scaler = mixprec.GradScaler()
        >>> hook = LoggingHook(every_n=1).attach(scaler)
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
        >>> scaler.step(opt)
        >>> scaler.update()  # logs "mixprec: iteration 1: scale 65536, 0 of the last 1 ..."
    """

    def __init__(
        self,
        logger: logging.Logger | None = None,
        every_n: int = 100,
        level: int = logging.INFO,
        all_skipped_level: int = logging.WARNING,
    ) -> None:
        super().__init__(every_n)
        self.logger = logger if logger is not None else logging.getLogger("mixprec")
        self.level = level
        self.all_skipped_level = all_skipped_level

    def emit(self, record: UpdateRecord) -> None:
        """Log one line. Host sync: none."""
        level = self.all_skipped_level if record.skipped == record.window else self.level
        norm = "" if record.grad_norm is None else f", grad norm {record.grad_norm:.4g}"
        self.logger.log(
            level,
            "mixprec: iteration %d: scale %g, %d of the last %d steps skipped (%d in total)%s",
            record.iteration,
            record.scale,
            record.skipped,
            record.window,
            record.skipped_total,
            norm,
        )


class MetricsHook(WindowedUpdateHook):
    """Pass the scaler's metrics to any ``log(metrics, step=...)`` function.

    That is the signature of Lightning's ``trainer.logger.log_metrics``, accelerate's
    ``accelerator.log`` and ``wandb.log``, so the scale shows up in the experiment tracker the
    run already uses. Metrics: ``<prefix>scale``, ``<prefix>skipped`` (in the window),
    ``<prefix>skipped_total`` and, when passed with :meth:`record_grad_norm`,
    ``<prefix>grad_norm``; ``step`` is the scaler's iteration number.

    Args:
        log: the function, called as ``log(metrics: dict[str, float], step=iteration)``.
        every_n: updates per call (each call is one host sync).
        prefix: metric-name prefix.

    Raises:
        ConfigError: ``log`` is not callable, or ``every_n`` is not an int >= 1.

    Example:
        >>> import torch, mixprec
        >>> from mixprec.integrations import MetricsHook
        >>> rows = []
        >>> scaler = mixprec.GradScaler()
        >>> hook = MetricsHook(lambda metrics, step: rows.append((step, metrics))).attach(scaler)
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
        >>> scaler.step(opt)
        >>> scaler.update()
        >>> rows[0][1]["mixprec/scale"]
        65536.0
    """

    def __init__(self, log: Any, every_n: int = 1, prefix: str = "mixprec/") -> None:
        if not callable(log):
            raise ConfigError(
                f"log must be a function taking (metrics, step=...), got {type(log).__name__}; "
                "pass e.g. trainer.logger.log_metrics or accelerator.log."
            )
        super().__init__(every_n)
        self.log = log
        self.prefix = prefix

    def emit(self, record: UpdateRecord) -> None:
        """Call ``log`` once. Host sync: none."""
        metrics = {
            f"{self.prefix}scale": record.scale,
            f"{self.prefix}skipped": float(record.skipped),
            f"{self.prefix}skipped_total": float(record.skipped_total),
        }
        if record.grad_norm is not None:
            metrics[f"{self.prefix}grad_norm"] = record.grad_norm
        self.log(metrics, step=record.iteration)
