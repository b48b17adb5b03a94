"""Each optimizer's phase in the current iteration, and every error about the order of calls.

``READY --unscale_--> UNSCALED --step--> STEPPED`` and ``READY --step--> STEPPED``; ``update()``
(or ``reset_iteration()``) puts every optimizer back to READY. :class:`PhaseTable` is the only
code that assigns a phase, and this module the only one that raises ScalerStateError and
MissingGradError, each message saying what happened and what to do instead.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from mixprec._src.kernels.plan import ParamRef
from mixprec.errors import ConfigError, MissingGradError, ScalerStateError


class OptState(enum.Enum):
    """Where one optimizer stands in the current iteration (same names as torch's)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass(slots=True)
class OptimizerRecord:
    """What the scaler knows about one optimizer in the current iteration."""

    stage: OptState = OptState.READY
    # One 0-d float32 tensor per grad device; non-zero means overflow.
    found_inf_per_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    skipped: bool | None = None  # whether the step was skipped, once the host knows
    missing: list[ParamRef] = field(default_factory=list)  # grad-less when last checked
    optimizer: weakref.ref[torch.optim.Optimizer] | None = None
    # A clip coefficient the next step applies (clip_grad_norm_(..., in_step=True)).
    deferred: torch.Tensor | None = None


class PhaseTable:
    """The records of every optimizer touched since the last ``update()``, keyed by ``id``."""

    def __init__(self) -> None:
        self._records: dict[int, OptimizerRecord] = {}
        self._scaled = False
        self._recorder: list[Any] | None = None

    def __len__(self) -> int:
        return len(self._records)

    def peek(self, optimizer: object) -> OptimizerRecord | None:
        """The optimizer's record if it was touched this iteration, else None."""
        return self._records.get(id(optimizer))

    def get(self, optimizer: object) -> OptimizerRecord:
        """The optimizer's record, created READY on first use."""
        record = self._records.get(id(optimizer))
        if record is None:  # (not setdefault: that would build a record on every call)
            record = self._records[id(optimizer)] = OptimizerRecord()
        return record

    def stepped(self) -> list[torch.optim.Optimizer]:
        """The live optimizers stepped or unscaled this iteration."""
        refs = [r.optimizer for r in self._records.values() if r.optimizer is not None]
        return [o for o in (ref() for ref in refs) if o is not None]

    def note_scaled(self, output: Any) -> None:
        """``scale()`` returned ``output``: the iteration has begun."""
        self._scaled = True
        if self._recorder is not None:
            self._recorder.append(output)

    @contextmanager
    def recording(self) -> Iterator[list[Any]]:
        """Collect what ``scale()`` returns inside the block (a closure evaluation)."""
        outer, self._recorder = self._recorder, []
        try:
            yield self._recorder
        finally:
            self._recorder = outer

    def begin_unscale(self, optimizer: object, what: str = "unscale_") -> OptimizerRecord:
        """The record, after checking that unscaling it (``unscale_``, a clip) is allowed now."""
        record = self._touch(optimizer, what)
        prefix = "" if what == "unscale_" else f"{what}() unscales the gradients, so: "
        if record.stage is OptState.UNSCALED:
            raise ScalerStateError(
                f"{prefix}unscale_() has already been called on this optimizer since the last "
                "update(). Unscale each optimizer at most once per iteration, after all its "
                "gradients have been accumulated; with gradient accumulation call unscale_() "
                "only on the iteration that steps."
            )
        if record.stage is OptState.STEPPED:
            raise ScalerStateError(
                f"{prefix}unscale_() is being called after step() for this optimizer. step() "
                "already unscaled its gradients; call unscale_() before step(), or call update() "
                "first to start a new iteration."
            )
        return record

    def begin_step(self, optimizer: object, scaled: bool = True) -> OptimizerRecord:
        """The record, after checking that ``step`` is allowed now (``scaled``: the scale
        exists, or a closure will create it)."""
        self.require_scale(scaled, "step")
        record = self._touch(optimizer, "step")
        if record.stage is OptState.STEPPED:
            raise ScalerStateError(
                "step() has already been called on this optimizer since the last update(). "
                "Call scaler.update() once at the end of every iteration, after stepping every "
                "optimizer."
            )
        return record

    def mark_pass(
        self,
        record: OptimizerRecord,
        optimizer: torch.optim.Optimizer,
        missing: list[ParamRef],
        unscaled: bool,
        deferred: torch.Tensor | None = None,
    ) -> None:
        """A pass over the grads unscaled them (or measured them for a ``deferred`` clip), or
        checked them; remember which parameters had none."""
        if unscaled:
            record.stage = OptState.UNSCALED
            record.deferred = deferred
        record.missing = missing
        record.optimizer = weakref.ref(optimizer)

    def mark_stepped(
        self, record: OptimizerRecord, optimizer: torch.optim.Optimizer, skipped: bool | None
    ) -> None:
        """The optimizer was stepped (or its step skipped); a retry is refused."""
        record.stage = OptState.STEPPED
        record.skipped = skipped
        record.deferred = None
        record.optimizer = weakref.ref(optimizer)

    def reopen(self, record: OptimizerRecord) -> None:
        """READY again, with no clip pending: a closure is evaluated anew (or a step raised)."""
        record.stage = OptState.READY
        record.deferred = None

    def reopen_if_unchecked(self, record: OptimizerRecord) -> None:
        """READY again when ``step``'s own unscale found no grad, so that a retry after
        ``backward()`` unscales."""
        if not record.found_inf_per_device:
            record.stage = OptState.READY

    def shadow(self, flags: list[torch.Tensor]) -> None:
        """Stepped records for a Join shadow iteration, one per agreed flag (host sync: one
        each), under keys that no optimizer's ``id`` can take."""
        for key, found_inf in enumerate(flags):
            record = self._records[-1 - key] = OptimizerRecord(OptState.STEPPED)
            record.found_inf_per_device = {found_inf.device: found_inf}
            record.skipped = bool(found_inf.item() != 0)

    def end_iteration(self) -> None:
        """Every optimizer back to READY (``update()``, ``reset_iteration()``, a load)."""
        self._records.clear()
        self._scaled = False

    def require_scale(self, exists: bool, method: str) -> None:
        """Refuse ``method`` before the first ``scale()``."""
        if not exists:
            raise ScalerStateError(no_scale_message(method))

    def found_inf(
        self, record: OptimizerRecord, optimizer: object, device: torch.device
    ) -> torch.Tensor:
        """The record's overflow flags combined on ``device`` (non-zero: overflow), after
        refusing to step an optimizer none of whose grads was checked."""
        if not record.found_inf_per_device:
            raise MissingGradError(
                no_inf_checks_message("for this optimizer", record.missing, optimizer)
            )
        return combined(list(record.found_inf_per_device.values()), device)

    def outcome(self, device: torch.device) -> tuple[torch.Tensor, bool | None]:
        """``(the iteration's overflow flags combined on device, whether it overflowed if the
        host knows)``, after checking that ``update()`` has something to count."""
        flags: list[torch.Tensor] = []
        known = True
        overflow = False
        for record in self._records.values():
            flags.extend(record.found_inf_per_device.values())
            if record.skipped is None:
                known = False
            elif record.skipped:
                overflow = True
        if not flags:
            self._refuse_empty_update()
        return combined(flags, device), (overflow if known else None)

    def _refuse_empty_update(self) -> NoReturn:
        records = list(self._records.values())
        if not records:
            raise MissingGradError(
                "No inf checks were recorded prior to update(): no optimizer was unscaled or "
                "stepped since the last update(). Call scaler.step(optimizer) before "
                "scaler.update(), and update() once per iteration."
            )
        # touched by unscale_/step, which raised before checking anything
        touched = [r.optimizer for r in records if r.stage is OptState.READY and not r.missing]
        raised = [o for o in (ref() for ref in touched if ref is not None) if o is not None]
        if raised:
            count = sum(len(g["params"]) for o in raised for g in getattr(o, "param_groups", []))
            raise MissingGradError(
                "No inf checks were recorded prior to update(): unscale_() or step() was called "
                f"for {len(raised)} optimizer(s) ({count} parameter(s)) and raised before their "
                "gradients were checked. Fix what it raised and redo the iteration, or call "
                "scaler.reset_iteration() to abandon it."
            )
        missing = [ref for r in records for ref in r.missing]
        optimizers = [r.optimizer() for r in records if r.optimizer is not None]
        raise MissingGradError(no_inf_checks_message("prior to update", missing, *optimizers))

    def require_touched(self, optimizer: object) -> None:
        """``update(optimizer)``: that optimizer must have been unscaled or stepped."""
        record = self.peek(optimizer)
        if record is None or record.stage is OptState.READY:
            raise ScalerStateError(
                "update(optimizer) was given an optimizer that was neither unscaled nor stepped "
                "since the last update(). Call scaler.step(optimizer) (or "
                "scaler.unscale_(optimizer)) first, or call scaler.update() with no argument."
            )

    def require_between_iterations(self, what: str) -> None:
        """Refuse ``load_state_dict`` (or a copy) in the middle of an iteration."""
        happened = self._what_happened()
        if what == "load_state_dict" and happened is None and self._scaled:
            happened = "scale() was already called: the gradients are scaled with the current scale"
        if happened is None:
            return
        if what == "load_state_dict":
            raise ScalerStateError(
                f"load_state_dict() was called mid-iteration ({happened}). Load checkpoints "
                "between iterations: call scaler.update() or scaler.reset_iteration() first."
            )
        raise ScalerStateError(
            "A GradScaler can only be pickled or copied at the beginning of an iteration or "
            f"after update(); this one is mid-iteration ({happened}). Call scaler.update() first."
        )

    def _what_happened(self) -> str | None:
        if any(r.stage is not OptState.READY for r in self._records.values()):
            return "an optimizer was already unscaled or stepped with the current scale"
        if self._records:
            return "an optimizer was already passed to step() or unscale_(), which raised"
        return None

    def require_step_seen(self, flag: torch.Tensor | None, optimizer: object) -> torch.Tensor:
        """``last_step_skipped()``'s flag: there must be a step to report on."""
        if flag is None:
            raise ScalerStateError(
                "last_step_skipped() was called before any scaler.step() of "
                + ("this optimizer." if optimizer is not None else "any optimizer.")
            )
        return flag

    def refuse_unscaled_closure(self) -> NoReturn:
        """A closure evaluation returned without calling ``scaler.scale()``."""
        raise ScalerStateError(
            "The closure given to scaler.step(optimizer, closure) did not call scaler.scale(): "
            "its gradients are not scaled. Inside the closure write "
            "scaler.scale(loss).backward() instead of loss.backward()."
        )

    def refuse_ignored_closure(self, optimizer: object) -> NoReturn:
        """The optimizer's ``step`` returned without calling the closure."""
        raise ScalerStateError(
            f"{type(optimizer).__name__}.step() did not call the closure passed to "
            "scaler.step(optimizer, closure), so its gradients were never unscaled; the step was "
            "undone. Compute the loss before stepping and call scaler.step(optimizer) without "
            "a closure for this optimizer."
        )

    def _touch(self, optimizer: object, method: str) -> OptimizerRecord:
        """The record, after refusing a non-optimizer (a model is the usual mistake)."""
        if not hasattr(optimizer, "param_groups"):
            hint = (
                " Pass the optimizer, not the model."
                if isinstance(optimizer, torch.nn.Module)
                else ""
            )
            raise ConfigError(
                f"{method}() expects a torch.optim.Optimizer (an object with param_groups), got "
                f"{type(optimizer).__name__}.{hint}"
            )
        record = self.get(optimizer)
        record.optimizer = weakref.ref(optimizer)  # type: ignore[arg-type]
        return record


_MAX_LISTED = 8


def describe_params(refs: Sequence[ParamRef]) -> str:
    names = [ref.describe() for ref in refs[:_MAX_LISTED]]
    more = len(refs) - len(names)
    if more > 0:
        names.append(f"and {more} more")
    return ", ".join(names)


def no_scale_message(method: str) -> str:
    return (
        f"{method}() was called before scaler.scale(): the scale does not exist yet. Call "
        "scaler.scale(loss).backward() earlier in the iteration (the scale is created on the "
        "device of the first scaled output)."
    )


def low_precision_message(refs: Sequence[ParamRef]) -> str:
    return (
        f"Attempting to unscale FP16 gradients of {len(refs)} parameter(s): "
        f"{describe_params(refs)}. Unscaling fp16 gradients in place flushes small values to "
        "zero and the optimizer would update fp16 weights, losing small updates. Keep trainable "
        "parameters in float32 (do not call model.half(); autocast runs the ops in fp16 for "
        "you), or, to train fp16 parameters, wrap the optimizer with "
        "mixprec.MasterWeights(optimizer) before its first step: it keeps fp32 master copies "
        "that the scaler unscales and the optimizer updates. Frozen parameters "
        "(requires_grad=False) may stay fp16."
    )


def no_inf_checks_message(context: str, missing: Sequence[ParamRef], *optimizers: object) -> str:
    if missing:
        detail = (
            f"None of the optimizer's {len(missing)} parameter(s) has a .grad: "
            f"{describe_params(missing)}."
        )
    else:
        groups = [g for o in optimizers for g in getattr(o, "param_groups", [])]
        count = sum(len(g["params"]) for g in groups)
        if count == 0:
            detail = "The optimizer has no parameters."
        else:
            detail = (
                f"Its {count} parameter(s) were never checked: an optimizer written to torch's "
                "legacy fused contract (step(closure=None, grad_scaler=None)) must call "
                "grad_scaler._check_inf_per_device(self) in its step()."
            )
    return (
        f"No inf checks were recorded {context}. {detail} Make sure the loss was scaled and "
        "backward() ran before step() (scaler.scale(loss).backward()), that the optimizer was "
        "built from the parameters of the model that produced the loss, and that those "
        "parameters are used in the forward pass."
    )


def combined(found_infs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Overflow flags of several devices or optimizers combined on ``device``."""
    total = found_infs[0]
    if len(found_infs) == 1 and total.device == device:
        return total  # the common case, without a copy
    total = total.to(device, non_blocking=True)
    for other in found_infs[1:]:
        total = total + other.to(device, non_blocking=True)
    return total
