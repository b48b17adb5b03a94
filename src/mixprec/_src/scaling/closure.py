"""``scaler.step(optimizer, closure)``: optimizers that evaluate the loss several times per step.

LBFGS calls its closure up to ``max_eval`` times per step, SAM-style optimizers twice. Each
evaluation runs ``scaler.scale(loss).backward()`` and so leaves *scaled* gradients; the optimizer
must only ever see unscaled ones. :func:`step_with_closure` therefore hands the optimizer a closure
that wraps the user's: it runs the user's closure, unscales and checks that evaluation's gradients,
reads the overflow flag (one host sync) and returns the unscaled loss. On the first overflowing
evaluation it aborts the optimizer's step and restores the parameters and the optimizer's state
from a snapshot taken just before the step, so a skipped step changes nothing.

Memory: the snapshot is one copy of every parameter of the optimizer plus one deep copy of its
state (and of the state of any optimizer it wraps, such as SAM's ``base_optimizer``): for Adam
3x the parameters' size, for LBFGS 1x plus its history (``2 * history_size`` flat vectors).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mixprec._src.scaling.phases import OptimizerRecord, OptState
from mixprec.errors import ScalerStateError

if TYPE_CHECKING:
    from mixprec._src.scaling.grad_scaler import GradScaler


_Optimizer = torch.optim.Optimizer


@dataclass(frozen=True)
class ClosureCall:
    """The closure given to ``scaler.step`` and how to pass its replacement to the optimizer."""

    closure: Callable[[], Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    keyword: bool

    def invoke(self, optimizer: _Optimizer, wrapped: Callable[[], Any]) -> Any:
        """``optimizer.step`` with ``wrapped`` where the user's closure was.

        Host sync: whatever the optimizer and the closure do.
        """
        return self.invoke_with(optimizer.step, wrapped)

    def invoke_with(self, step: Callable[..., Any], wrapped: Callable[[], Any]) -> Any:
        """``step(...)`` with ``wrapped`` where the user's closure was.

        Host sync: whatever ``step`` and the closure do.
        """
        if self.keyword:
            return step(*self.args, closure=wrapped, **self.kwargs)
        return step(wrapped, *self.args, **self.kwargs)


def split_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> ClosureCall | None:
    """The closure passed to ``step`` (``closure=`` or first positional), or None.

    Host sync: none.
    """
    if kwargs.get("closure") is not None:
        rest = {k: v for k, v in kwargs.items() if k != "closure"}
        return ClosureCall(kwargs["closure"], args, rest, keyword=True)
    if args and callable(args[0]):
        return ClosureCall(args[0], args[1:], kwargs, keyword=False)
    return None


def _optimizers_within(optimizer: _Optimizer) -> list[_Optimizer]:
    """The optimizer and those it wraps (attributes that are optimizers, e.g. SAM's base)."""
    inner = [v for v in vars(optimizer).values() if isinstance(v, _Optimizer)]
    unique: dict[int, _Optimizer] = {id(optimizer): optimizer}
    for other in inner:
        unique.setdefault(id(other), other)
    return list(unique.values())


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
        snap = cls(masters=getattr(optimizer, "_mixprec_master_weights", None))
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


@contextmanager
def _recording_scaled_outputs(scaler: GradScaler, outputs: list[Any]) -> Iterator[None]:
    """Record what ``scaler.scale`` returns, to recognise a closure that returns it."""
    original = scaler.scale

    def recording(value: Any) -> Any:
        result = original(value)
        outputs.append(result)
        return result

    setattr(scaler, "scale", recording)  # noqa: B010 (an instance attribute shadows the method)
    try:
        yield
    finally:
        delattr(scaler, "scale")


class _Evaluation:
    """The closure the optimizer sees: the user's closure, then unscale, check, unscale loss."""

    def __init__(self, scaler: GradScaler, optimizer: _Optimizer, call: ClosureCall) -> None:
        self.scaler = scaler
        self.optimizer = optimizer
        self.closure = call.closure
        self.count = 0
        self.overflowed = False

    def __call__(self) -> Any:
        scaler, optimizer = self.scaler, self.optimizer
        record = scaler._phases.get(optimizer)
        record.stage = OptState.READY  # the user's closure may call unscale_ itself (to clip)
        scaled: list[Any] = []
        with _recording_scaled_outputs(scaler, scaled):
            loss = self.closure()
        if scaler._get_scale_async() is None:
            raise ScalerStateError(
                "The closure given to scaler.step(optimizer, closure) did not call "
                "scaler.scale(): its gradients are not scaled. Inside the closure write "
                "scaler.scale(loss).backward() instead of loss.backward()."
            )
        if record.stage is OptState.READY:
            scaler._unscale_into(optimizer, record)
        self.count += 1
        found = scaler._sum_found_inf(record, optimizer)
        if found.item() != 0:
            self.overflowed = True
            raise _Overflow
        if isinstance(loss, torch.Tensor) and any(loss is s for s in scaled):
            return loss / scaler._scale_on(loss.device)
        return loss


def _overflowed_before(scaler: GradScaler, optimizer: _Optimizer, record: OptimizerRecord) -> bool:
    """Whether the gradients unscaled before the step (SAM's first pass) overflowed."""
    return bool(scaler._sum_found_inf(record, optimizer).item() != 0)


def step_with_closure(scaler: GradScaler, optimizer: _Optimizer, call: ClosureCall) -> Any:
    """Step ``optimizer`` with a closure whose every evaluation is unscaled and checked.

    If the record is already UNSCALED (the user ran a first pass and called ``unscale_``, as
    SAM's ``step(closure)`` expects), those gradients count too: an overflow there skips the
    step without calling the optimizer. Otherwise the step is skipped, and everything restored,
    at the first overflowing evaluation.

    Host sync: one per closure evaluation (plus one when the record was already unscaled).
    """
    record = scaler._phases.check_can_step(optimizer)
    record.optimizer = weakref.ref(optimizer)
    if record.stage is OptState.UNSCALED and _overflowed_before(scaler, optimizer, record):
        return _finish(scaler, optimizer, record, skipped=True, result=None)
    snapshot = Snapshot.take(optimizer)
    evaluation = _Evaluation(scaler, optimizer, call)
    try:
        result = call.invoke(optimizer, evaluation)
    except _Overflow:
        result = None
    except BaseException:
        snapshot.restore()
        record.stage = OptState.READY
        raise
    if evaluation.overflowed:
        snapshot.restore()
        return _finish(scaler, optimizer, record, skipped=True, result=None)
    if evaluation.count == 0:
        snapshot.restore()
        raise ScalerStateError(
            f"{type(optimizer).__name__}.step() did not call the closure passed to "
            "scaler.step(optimizer, closure), so its gradients were never unscaled; the step was "
            "undone. Compute the loss before stepping and call scaler.step(optimizer) without "
            "a closure for this optimizer."
        )
    return _finish(scaler, optimizer, record, skipped=False, result=result)


def _finish(
    scaler: GradScaler, optimizer: _Optimizer, record: OptimizerRecord, skipped: bool, result: Any
) -> Any:
    scaler._note_step(optimizer, scaler._sum_found_inf(record, optimizer))
    record.skipped = skipped
    record.stage = OptState.STEPPED
    return result
