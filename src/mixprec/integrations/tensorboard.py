"""TensorBoard: an update hook that writes the scale, the skips and the grad norm, and the
scalars of a :class:`mixprec.Watch` (pass ``hook=tensorboard_hook.record_watch``).

Uses ``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard`` package
(``pip install 'mixprec[tensorboard]'``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mixprec._src.deps import require
from mixprec.integrations.hooks import UpdateRecord, WindowedUpdateHook

__all__ = ["TensorBoardHook"]


class TensorBoardHook(WindowedUpdateHook):
    """Write ``<prefix>scale``, ``<prefix>log2_scale``, ``<prefix>skipped`` (skipped
    iterations in the window), ``<prefix>skipped_total`` and, when passed with
    :meth:`record_grad_norm`, ``<prefix>grad_norm``, at the scaler's iteration number.

    Args:
        writer: a ``SummaryWriter`` (or anything with ``add_scalar``), or a log directory for
            a new one, which :meth:`close` then closes.
        every_n: updates per write (each write is one host sync).
        prefix: tag prefix.

    Raises:
        ImportError: a log directory was given and ``tensorboard`` is not installed.
        ConfigError: ``every_n`` is not an int >= 1.

    Example:
        >>> import tempfile, torch, mixprec
        >>> from mixprec.integrations.tensorboard import TensorBoardHook
        >>> scaler = mixprec.GradScaler()
        >>> hook = TensorBoardHook(tempfile.mkdtemp()).attach(scaler)
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
        >>> hook.record_grad_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        >>> scaler.step(opt)
        >>> scaler.update()
        >>> hook.close()
    """

    def __init__(self, writer: Any, every_n: int = 1, prefix: str = "mixprec/") -> None:
        super().__init__(every_n)
        self._owns_writer = isinstance(writer, (str, Path))
        if self._owns_writer:
            board = require("torch.utils.tensorboard", "tensorboard", "TensorBoardHook")
            writer = board.SummaryWriter(log_dir=str(writer))
        self.writer = writer
        self.prefix = prefix

    def emit(self, record: UpdateRecord) -> None:
        """Add the record's scalars. Host sync: none."""
        step, tag = record.iteration, self.prefix
        self.writer.add_scalar(f"{tag}scale", record.scale, step)
        self.writer.add_scalar(f"{tag}log2_scale", math.log2(record.scale), step)
        self.writer.add_scalar(f"{tag}skipped", record.skipped, step)
        self.writer.add_scalar(f"{tag}skipped_total", record.skipped_total, step)
        if record.grad_norm is not None:
            self.writer.add_scalar(f"{tag}grad_norm", record.grad_norm, step)

    def record_watch(self, report: Any) -> None:
        """Write a :class:`~mixprec.types.WatchReport` at its step: ``<prefix>watch/predicted_sqnr``
        and, per measured module, ``<prefix>watch/<module>/sqnr`` (its whole-model gradient
        SQNR in its chosen precision), ``.../margin`` (dB below bf16 at that step),
        ``.../saturated`` and ``.../flushed`` (fp8), and ``<prefix>watch/alerts``. Use it as
        ``mixprec.Watch(..., hook=board.record_watch)``.

        Host sync: none (the report holds host numbers).
        """
        tag, step = f"{self.prefix}watch/", report.step
        if math.isfinite(report.predicted_sqnr):
            self.writer.add_scalar(f"{tag}predicted_sqnr", report.predicted_sqnr, step)
        self.writer.add_scalar(f"{tag}alerts", len(report.alerts), step)
        for rec in report.records:
            values = {
                "sqnr": rec.model_grad_sqnr,
                "margin": rec.margin,
                "saturated": rec.saturated,
                "flushed": rec.flushed,
            }
            for key, value in values.items():
                if value is not None and math.isfinite(value):
                    self.writer.add_scalar(f"{tag}{rec.name}/{key}", value, step)

    def close(self) -> None:
        """Write the last partial window, unregister, and flush (or close, if this hook
        created it) the writer.

        Host sync: one, when a partial window is pending.
        """
        self.flush()
        self.detach()
        if self._owns_writer:
            self.writer.close()
        elif hasattr(self.writer, "flush"):
            self.writer.flush()
