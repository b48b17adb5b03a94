"""The measurement engine: the float32 reference pass, isolated passes, policy passes.

Every pass runs the loss function on every batch, then backward (of the loss times the loss scale
when float16 is involved), then takes the parameters' gradients. Between passes the
:class:`~mixprec._src.advisor.state.Guard` resets gradients, buffers and RNG state, so every pass
starts from the same state and sees the same random numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec._src.advisor.candidates import Candidate
from mixprec._src.advisor.checks import LOSS_FORM
from mixprec._src.advisor.metrics import FP16_MAX, Power
from mixprec._src.advisor.state import Guard
from mixprec._src.advisor.taps import Record, Tap, around, attached
from mixprec._src.advisor.timing import FlopCount, counting
from mixprec.errors import ConfigError

#: Powers of two of headroom between the largest reference gradient times the proposed initial
#: scale and the float16 maximum (gradients grow during training; the scaler grows the scale).
SCALE_HEADROOM = 2.0**4
SCALE_RANGE = (2.0**-24, 2.0**24)

Progress = Callable[[int, int, str], None]


@dataclass
class Target:
    """One measured module and what the reference pass recorded of it."""

    name: str
    module: nn.Module
    param_index: list[int]
    record: Record = field(default_factory=Record)


@dataclass
class Job:
    """Everything a run of the advisor works on."""

    model: nn.Module
    batches: Sequence[Any]
    loss_fn: Callable[[nn.Module, Any], Any]
    device: torch.device
    candidates: list[Candidate]
    region: torch.dtype
    progress: Progress | None = None
    total_passes: int = 0


class Engine:
    """Runs passes on a guarded model and counts them. Host sync: several per pass."""

    def __init__(self, job: Job, guard: Guard) -> None:
        self.job = job
        self.guard = guard
        self.passes = 0
        self.scale = 1.0
        self.reference: list[torch.Tensor | None] = []

    @property
    def device_type(self) -> str:
        return self.job.device.type

    def run(
        self,
        label: str,
        taps: Sequence[Tap] = (),
        isolate: tuple[nn.Module, Callable[[], AbstractContextManager[Any]]] | None = None,
        region: Callable[[], AbstractContextManager[Any]] | None = None,
        outer: AbstractContextManager[Any] | None = None,
    ) -> list[torch.Tensor | None]:
        """One forward+backward pass over every batch (inside ``outer``, if given); returns the
        unscaled gradients."""
        self.guard.reset()
        with ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            stack.enter_context(attached(list(taps)))
            if isolate is not None:
                stack.enter_context(around(*isolate))
            if outer is not None:
                stack.enter_context(outer)
            for batch in self.job.batches:
                with region() if region is not None else ExitStack():
                    loss = _checked_loss(self._loss(batch))
                (loss.float() * self.scale).backward()
        grads = self.guard.take_grads()
        self.passes += 1
        if self.job.progress is not None:
            self.job.progress(self.passes, self.job.total_passes, label)
        if self.scale == 1.0:
            return grads
        return [None if g is None else g.float() / self.scale for g in grads]

    def _loss(self, batch: Any) -> Any:
        """``loss_fn(model, batch)``; in the first pass, an error raised before the model ran
        means the function is not of that form (``F.mse_loss(output, target)``)."""
        if self.passes:
            return self.job.loss_fn(self.job.model, batch)
        ran: list[bool] = []
        ours = {id(m) for m in self.job.model.modules()}

        def seen(module: nn.Module, args: Any) -> None:
            if id(module) in ours:
                ran.append(True)

        handle = nn.modules.module.register_module_forward_pre_hook(seen)
        try:
            return self.job.loss_fn(self.job.model, batch)
        except Exception as exc:
            if ran:
                raise
            raise ConfigError(
                f"loss_fn(model, batch) raised {type(exc).__name__}: {exc} before calling the "
                f"model; {LOSS_FORM}"
            ) from exc
        finally:
            handle.remove()

    def run_reference(self, targets: Sequence[Target], flops: FlopCount | None = None) -> None:
        """The float32 pass: records every target (and counts the matmul FLOP into ``flops``);
        raises if it is not finite."""
        taps = [Tap(t.module) for t in targets]
        grads = self.run("float32 reference", taps, outer=counting(flops))
        for target, tap in zip(targets, taps, strict=True):
            target.record = tap.record
        bad = [
            name
            for (name, p), g in zip(self.job.model.named_parameters(), grads, strict=True)
            if g is not None and not bool(torch.isfinite(g).all())
        ]
        if bad:
            raise ConfigError(
                f"the float32 reference pass gave inf/NaN gradients for {bad[:5]}; the advisor "
                "compares low precision with a finite float32 run: fix the model or the batch "
                "first (mixprec.find_nonfinite says where the first inf/NaN appears)"
            )
        if all(g is None for g in grads):
            raise ConfigError(
                "no parameter received a gradient in the float32 reference pass: the loss does "
                "not depend on any parameter that requires grad"
            )
        self.reference = [None if g is None else g.float() for g in grads]

    def model_power(self, grads: Sequence[torch.Tensor | None]) -> Power:
        power = Power()
        power.add_all(grads, self.reference)
        return power

    def subset_power(self, grads: Sequence[torch.Tensor | None], index: Sequence[int]) -> Power:
        power = Power()
        power.add_all([grads[i] for i in index], [self.reference[i] for i in index])
        return power


def _checked_loss(loss: object) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = (
            f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
            if isinstance(loss, torch.Tensor)
            else f"{type(loss).__name__}"
        )
        raise ConfigError(
            f"loss_fn(model, batch) must return the loss as a floating tensor with one "
            f"element; it returned {got}"
        )
    if not loss.requires_grad:
        raise ConfigError(
            "the loss returned by loss_fn(model, batch) does not require grad: no parameter "
            "that requires grad took part, or it was computed under torch.no_grad()"
        )
    return loss


def propose_scale(targets: Sequence[Target], grads: Sequence[torch.Tensor | None]) -> float:
    """The largest power of two that keeps every reference gradient SCALE_HEADROOM times below
    the float16 maximum (clamped to SCALE_RANGE). Host sync: one per tensor."""
    largest = 0.0
    for tensor in _all_grads(targets, grads):
        largest = max(largest, float(tensor.abs().max()))
    if largest == 0.0:
        return SCALE_RANGE[1]
    exponent = math.floor(math.log2(FP16_MAX / (largest * SCALE_HEADROOM)))
    return float(min(max(2.0**exponent, SCALE_RANGE[0]), SCALE_RANGE[1]))


def _all_grads(
    targets: Sequence[Target], grads: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    out = [g for g in grads if g is not None and g.numel()]
    for t in targets:
        for calls in (t.record.output_grads, t.record.input_grads):
            out += [g for call in calls for g in call if g is not None and g.numel()]
    return out
