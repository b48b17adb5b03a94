"""``scaler.step(optimizer, closure)`` (LBFGS, SAM: the loss evaluated several times per step).

The optimizer gets a closure that runs the user's, then unscales and checks that evaluation's
gradients (one host sync) and returns the unscaled loss. The first overflowing evaluation aborts
the step and restores parameters and optimizer state from a snapshot taken before it, so a skipped
step changes nothing (its memory: ``docs/closures.md``). The scaler's side is :class:`Stepper`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mixprec._src.optim import ClosureCall, masters_of
from mixprec._src.scaling.phases import OptimizerRecord, OptState, PhaseTable

_Optimizer = torch.optim.Optimizer


class Stepper(Protocol):
    """What a closure step asks of the scaler."""

    def _evaluated(self, optimizer: _Optimizer, record: OptimizerRecord) -> bool:
        """Unscale (unless done) and check the grads; whether they overflowed (one host sync)."""

    def _unscaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` divided by the scale."""

    def _stepped(self, optimizer: _Optimizer, record: OptimizerRecord, skipped: bool) -> None:
        """The step ended, taken or skipped."""


def _optimizers_within(optimizer: _Optimizer) -> list[_Optimizer]:
    """The optimizer and those it wraps (attributes that are optimizers, e.g. SAM's base)."""
    inner = [v for v in vars(optimizer).values() if isinstance(v, _Optimizer)]
    return list({id(o): o for o in [optimizer, *inner]}.values())


@dataclass
class Snapshot:
    """Copies of parameters, optimizer state and hyperparameters, restored bit for bit."""

    params: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    states: list[tuple[_Optimizer, dict[Any, Any]]] = field(default_factory=list)
    groups: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    masters: Any = None  # the optimizer's MasterWeights: its model copies follow the masters

    @classmethod
    def take(cls, optimizer: _Optimizer) -> Snapshot:
        """Copy everything ``optimizer.step`` may change. Host sync: none."""
        snap = cls()
        seen: set[int] = set()
        for opt in _optimizers_within(optimizer):
            memo: dict[int, Any] = {}
            for group in opt.param_groups:
                for p in group["params"]:
                    memo[id(p)] = p  # state that refers to a parameter keeps referring to it
                    if id(p) not in seen:
                        seen.add(id(p))
                        snap.params.append((p, p.detach().clone()))
                rest = {k: v for k, v in group.items() if k != "params"}
                snap.groups.append((group, copy.deepcopy(rest, memo)))
            state = {p: copy.deepcopy(s, memo) for p, s in opt.state.items()}
            snap.states.append((opt, state))
        snap.masters = masters_of(optimizer)
        return snap

    def restore(self) -> None:
        """Put every copied value back. Host sync: none."""
        with torch.no_grad():
            for param, saved in self.params:
                param.copy_(saved)
        for opt, state in self.states:
            opt.state.clear()
            opt.state.update(state)
        for group, saved_group in self.groups:
            params = group["params"]
            group.clear()
            group.update(saved_group)
            group["params"] = params
        if self.masters is not None:
            self.masters.refresh()


class _Overflow(Exception):
    """Raised through ``optimizer.step`` to abort it at the first overflowing evaluation."""


@dataclass
class _Evaluation:
    """The closure the optimizer sees: the user's closure, then unscale, check, unscale loss."""

    scaler: Stepper
    phases: PhaseTable
    optimizer: _Optimizer
    record: OptimizerRecord
    closure: Any
    count: int = 0
    overflowed: bool = False

    def __call__(self) -> Any:
        self.phases.reopen(self.record)  # the user's closure may call unscale_ itself (to clip)
        with self.phases.recording() as scaled:
            loss = self.closure()
        if not scaled:  # its gradients are unscaled already: unscaling them again is wrong
            self.phases.refuse_unscaled_closure()
        self.count += 1
        if self.scaler._evaluated(self.optimizer, self.record):
            self.overflowed = True
            raise _Overflow
        if isinstance(loss, torch.Tensor) and any(loss is s for s in scaled):
            return self.scaler._unscaled(loss)
        return loss


def step_with_closure(
    scaler: Stepper,
    phases: PhaseTable,
    optimizer: _Optimizer,
    record: OptimizerRecord,
    call: ClosureCall,
) -> Any:
    """Step ``optimizer`` with a closure whose every evaluation is unscaled and checked; grads
    already unscaled (SAM's first pass) are checked first, and an overflow there skips the step
    without calling the optimizer. Host sync: one per evaluation (and for unscaled grads)."""
    if record.stage is OptState.UNSCALED and scaler._evaluated(optimizer, record):
        scaler._stepped(optimizer, record, skipped=True)
        return None
    evaluation = _Evaluation(scaler, phases, optimizer, record, call.closure)
    snapshot = Snapshot.take(optimizer)
    try:
        result = call.invoke(optimizer, evaluation)
    except _Overflow:
        result = None
    except BaseException:
        phases.reopen(record)
        snapshot.restore()
        raise
    if evaluation.overflowed or evaluation.count == 0:
        snapshot.restore()
    if evaluation.count == 0:
        phases.refuse_ignored_closure(optimizer)
    scaler._stepped(optimizer, record, skipped=evaluation.overflowed)
    return None if evaluation.overflowed else result
