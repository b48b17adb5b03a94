"""An LR scheduler wrapper that advances only on real optimizer updates.

Loss scaling skips the optimizer step of every iteration whose gradients overflowed. Plain loops,
Lightning and most trainers still step the LR scheduler after such an iteration, so a warm-up or a
decay runs ahead of the updates actually made (and torch warns that ``lr_scheduler.step()`` ran
before ``optimizer.step()`` when the very first step is skipped). :class:`SkipAwareScheduler`
asks the scaler whether the optimizer's last step was skipped and, if so, does not step.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._src.scaling.grad_scaler import GradScaler
from mixprec.errors import ConfigError, ScalerStateError

__all__ = ["SkipAwareScheduler"]


class SkipAwareScheduler:
    """Wrap an LR scheduler so that ``step()`` does nothing after a skipped optimizer step.

    Every other attribute (``get_last_lr``, ``optimizer``, ``last_epoch``, ...) is the wrapped
    scheduler's, and ``state_dict``/``load_state_dict`` are the wrapped scheduler's own, so
    checkpoints are unchanged: a checkpoint written with the wrapper loads without it and back.

    Args:
        scheduler: any object with ``step()`` and, unless ``optimizer`` is given, an
            ``optimizer`` attribute (every ``torch.optim.lr_scheduler`` class).
        scaler: the :class:`~mixprec.GradScaler` that steps that optimizer.
        optimizer: the optimizer whose steps count (default: ``scheduler.optimizer``).

    Raises:
        ConfigError: ``scheduler`` has no ``step`` or no ``optimizer`` and none was given.

    Example:
        >>> import torch, mixprec
        >>> from mixprec.integrations import SkipAwareScheduler
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = mixprec.GradScaler(init_scale=2.0**40)  # the first step overflows
        >>> sched = SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), scaler)
        >>> loss = model(torch.full((8, 4), 1e30)).pow(2).mean()
        >>> scaler.scale(loss).backward()
        >>> scaler.step(opt)
        >>> scaler.update()
        >>> sched.step()
        >>> (sched.skipped_steps, sched.get_last_lr())
        (1, [0.1])
    """

    def __init__(
        self,
        scheduler: Any,
        scaler: GradScaler,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        if not callable(getattr(scheduler, "step", None)):
            raise ConfigError(
                f"scheduler must have a step() method, got {type(scheduler).__name__}. Pass an "
                "LR scheduler such as torch.optim.lr_scheduler.StepLR."
            )
        optimizer = optimizer if optimizer is not None else getattr(scheduler, "optimizer", None)
        if optimizer is None:
            raise ConfigError(
                f"{type(scheduler).__name__} has no 'optimizer' attribute; pass the optimizer "
                "it follows: SkipAwareScheduler(scheduler, scaler, optimizer=opt)."
            )
        self.scheduler = scheduler
        self.scaler = scaler
        self.watched_optimizer = optimizer
        self.skipped_steps = 0

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Step the wrapped scheduler unless the optimizer's last step was skipped.

        Returns the wrapped ``step``'s value, or ``None`` when it was not called. The count of
        calls not passed on is in ``skipped_steps``. Before the scaler has stepped the optimizer
        at all, every call is passed on (nothing was skipped).

        Host sync: one (``scaler.last_step_skipped``); free on the CPU.
        """
        if self.last_step_skipped():
            self.skipped_steps += 1
            return None
        return self.scheduler.step(*args, **kwargs)

    def last_step_skipped(self) -> bool:
        """Whether the scaler skipped the watched optimizer's last step.

        Host sync: one; free on the CPU.
        """
        try:
            return self.scaler.last_step_skipped(self.watched_optimizer)
        except ScalerStateError:
            return False  # the scaler has not stepped this optimizer yet: nothing was skipped

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state dict. Host sync: none."""
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped scheduler. Host sync: none."""
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # during unpickling, before __dict__ is filled
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"SkipAwareScheduler({self.scheduler!r}, skipped_steps={self.skipped_steps})"
