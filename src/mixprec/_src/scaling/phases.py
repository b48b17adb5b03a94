"""Per-optimizer phase of an iteration and its transitions.

``READY --unscale_--> UNSCALED --step--> STEPPED`` and ``READY --step--> STEPPED``; ``update()``
puts every optimizer back to READY. This module is the one place that raises misuse errors about
the order of calls, each message saying what happened and what to do instead.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field

import torch

from mixprec._src.kernels.plan import ParamRef
from mixprec.errors import ConfigError, ScalerStateError


class OptState(enum.Enum):
    """Where one optimizer stands in the current iteration (same names as torch's)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class OptimizerRecord:
    """What the scaler knows about one optimizer in the current iteration.

    Attributes:
        stage: the optimizer's phase.
        found_inf_per_device: one 0-d float32 tensor per grad device; non-zero means overflow.
        skipped: whether the last step was skipped, once known on the host (None until then).
        missing: parameters without a grad when the grads were last checked (for messages).
        optimizer: a weak reference to the optimizer, for diagnostics.
    """

    stage: OptState = OptState.READY
    found_inf_per_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    skipped: bool | None = None
    missing: list[ParamRef] = field(default_factory=list)
    optimizer: weakref.ref[torch.optim.Optimizer] | None = None

    def mark_checked(self, optimizer: torch.optim.Optimizer, missing: list[ParamRef]) -> None:
        """Remember which optimizer this is and which of its parameters had no grad."""
        self.missing = missing
        self.optimizer = weakref.ref(optimizer)

    def mark_unscaled(self, optimizer: torch.optim.Optimizer, missing: list[ParamRef]) -> None:
        """The optimizer's grads were unscaled (by ``unscale_`` or a clipping call)."""
        self.stage = OptState.UNSCALED
        self.mark_checked(optimizer, missing)


class PhaseTable:
    """The records of every optimizer touched since the last ``update()``, keyed by ``id``."""

    def __init__(self) -> None:
        self._records: dict[int, OptimizerRecord] = {}

    def __len__(self) -> int:
        return len(self._records)

    def get(self, optimizer: object) -> OptimizerRecord:
        """The optimizer's record, created READY on first use."""
        return self._records.setdefault(id(optimizer), OptimizerRecord())

    def peek(self, optimizer: object) -> OptimizerRecord | None:
        """The optimizer's record if it was touched this iteration, else None."""
        return self._records.get(id(optimizer))

    def records(self) -> list[OptimizerRecord]:
        """All records of this iteration, in the order the optimizers were first touched."""
        return list(self._records.values())

    def clear(self) -> None:
        """Every optimizer back to READY (the end of an iteration)."""
        self._records.clear()

    def check_can_unscale(self, optimizer: object) -> OptimizerRecord:
        """The record, after checking that ``unscale_`` is allowed now."""
        _check_optimizer(optimizer, "unscale_")
        record = self.get(optimizer)
        if record.stage is OptState.UNSCALED:
            raise ScalerStateError(
                "unscale_() has already been called on this optimizer since the last update(). "
                "Unscale each optimizer at most once per iteration, after all its gradients "
                "have been accumulated; with gradient accumulation call unscale_() only on the "
                "iteration that steps."
            )
        if record.stage is OptState.STEPPED:
            raise ScalerStateError(
                "unscale_() is being called after step() for this optimizer. step() already "
                "unscaled its gradients; call unscale_() before step(), or call update() first "
                "to start a new iteration."
            )
        return record

    def check_can_step(self, optimizer: object) -> OptimizerRecord:
        """The record, after checking that ``step`` is allowed now."""
        _check_optimizer(optimizer, "step")
        record = self.get(optimizer)
        if record.stage is OptState.STEPPED:
            raise ScalerStateError(
                "step() has already been called on this optimizer since the last update(). "
                "Call scaler.update() once at the end of every iteration, after stepping every "
                "optimizer."
            )
        return record


def _check_optimizer(optimizer: object, method: str) -> None:
    """Refuse a non-optimizer before any record exists for it (a model is the usual mistake)."""
    if not hasattr(optimizer, "param_groups"):
        hint = (
            " Pass the optimizer, not the model." if isinstance(optimizer, torch.nn.Module) else ""
        )
        raise ConfigError(
            f"{method}() expects a torch.optim.Optimizer (an object with param_groups), got "
            f"{type(optimizer).__name__}.{hint}"
        )
