"""Adapters between mixprec and the tools users already run: Lightning, accelerate, TensorBoard,
``logging`` and matplotlib.

Every submodule imports its third-party package only when used, and says which extra to install
when it is missing; ``import mixprec`` never imports any of them.

* :mod:`mixprec.integrations.lightning`: a precision plugin (``pip install 'mixprec[lightning]'``).
* :mod:`mixprec.integrations.accelerate`: ``use_mixprec_scaler(accelerator)``, and
  ``use_mixprec_policy(accelerator or trainer, policy)`` (the 🤗 ``Trainer`` too)
  (``pip install 'mixprec[accelerate]'``).
* :class:`LoggingHook` (plain ``logging``), :class:`MetricsHook` (any ``log(metrics, step=)``:
  Lightning loggers, ``accelerator.log``, wandb) and
  :class:`~mixprec.integrations.tensorboard.TensorBoardHook`: update hooks that write the scale,
  the skips and the grad norm (TensorBoard: ``pip install 'mixprec[tensorboard]'``).
* :func:`mixprec.plot` draws a scale history with matplotlib (``pip install 'mixprec[plot]'``).
* :mod:`mixprec.integrations.schedulers`: :class:`SkipAwareScheduler`, an LR scheduler that does
  not advance on skipped steps (no extra needed).
"""

from __future__ import annotations

from mixprec.integrations.hooks import (
    LoggingHook,
    MetricsHook,
    UpdateRecord,
    WindowedUpdateHook,
)
from mixprec.integrations.schedulers import SkipAwareScheduler

__all__ = [
    "LoggingHook",
    "MetricsHook",
    "SkipAwareScheduler",
    "UpdateRecord",
    "WindowedUpdateHook",
]
