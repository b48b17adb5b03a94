"""The passes: the float32 reference, one module alone in a candidate, the region under a policy.

Every pass runs the loss function on every batch, then backward (of the loss times the loss scale
when float16 is involved), then takes the parameters' gradients. Between passes the
:class:`~mixprec._src.advisor.measure.guard.Guard` resets gradients, buffers and RNG state, so
every pass starts from the same state and sees the same random numbers. Every pass runs in a
disabled region without a policy, so that the reference is float32 (and a module's isolated
pass runs only its own region) also where ``advise`` or ``Watch.step`` is called inside an
autocast region; the caller's region is back in force when the pass ends.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec._src.advisor.arguments import LOSS_FORM
from mixprec._src.advisor.candidates import Candidate
from mixprec._src.advisor.measure.guard import Guard
from mixprec._src.advisor.measure.metrics import FP16_MAX, Fp16Range, Power, fp16_range
from mixprec._src.advisor.measure.taps import Record, Tap, around, attached
from mixprec._src.advisor.report.advice import Measurement
from mixprec._src.advisor.speed.shapes import FlopCount, Gemms, counting, gemm_shapes
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.region import autocast
from mixprec._src.fp8.stats import Fp8Stats
from mixprec.errors import ConfigError

#: Powers of two of headroom between the largest reference gradient times the proposed initial
#: scale and the float16 maximum (gradients grow during training; the scaler grows the scale).
SCALE_HEADROOM = 2.0**4
SCALE_RANGE = (2.0**-24, 2.0**24)

Progress = Callable[[int, int, str], None]


@dataclass
class Subject:
    """One measured module and what the reference pass recorded of it: its tensors and its
    GEMMs (all the speed model needs of it)."""

    name: str
    module: nn.Module
    param_index: list[int]
    record: Record = field(default_factory=Record)
    shapes: Gemms | None = None


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


class Engine:
    """Runs passes on a guarded model and counts them: the one owner of the pass count (done,
    and the total that ``progress`` is told). Host sync: several per pass."""

    def __init__(self, job: Job, guard: Guard, planned: int = 0) -> None:
        self.job = job
        self.guard = guard
        self.passes = 0
        self.planned = planned
        self.scale = 1.0
        self.reference: list[torch.Tensor | None] = []

    def expect(self, more: int) -> None:
        """``more`` passes beyond (or, negative, short of) the plan: the progress total."""
        self.planned += more

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
            stack.enter_context(_passing())
            stack.enter_context(torch.enable_grad())
            stack.enter_context(_float32(self.device_type))
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
            self.job.progress(self.passes, max(self.planned, self.passes), label)
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

    def run_reference(self, subjects: Sequence[Subject], flops: FlopCount | None = None) -> None:
        """The float32 pass: records every subject (and counts the matmul FLOP into ``flops``);
        raises if it is not finite."""
        taps = [Tap(t.module) for t in subjects]
        grads = self.run("float32 reference", taps, outer=counting(flops))
        for subject, tap in zip(subjects, taps, strict=True):
            subject.record = tap.record
            subject.shapes = gemm_shapes(subject.module, tap.record)
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


def propose_scale(subjects: Sequence[Subject], grads: Sequence[torch.Tensor | None]) -> float:
    """The largest power of two that keeps every reference gradient SCALE_HEADROOM times below
    the float16 maximum (clamped to SCALE_RANGE). Host sync: one per tensor."""
    largest = 0.0
    for tensor in _all_grads(subjects, grads):
        largest = max(largest, float(tensor.abs().max()))
    if largest == 0.0:
        return SCALE_RANGE[1]
    exponent = math.floor(math.log2(FP16_MAX / (largest * SCALE_HEADROOM)))
    return float(min(max(2.0**exponent, SCALE_RANGE[0]), SCALE_RANGE[1]))


def _all_grads(
    subjects: Sequence[Subject], grads: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    out = [g for g in grads if g is not None and g.numel()]
    for t in subjects:
        for calls in (t.record.output_grads, t.record.input_grads):
            out += [g for call in calls for g in call if g is not None and g.numel()]
    return out


_PASS = threading.local()


def in_pass() -> bool:
    """Whether this thread is inside one of the advisor's passes. Host sync: none."""
    return getattr(_PASS, "depth", 0) > 0


@contextmanager
def _passing() -> Iterator[None]:
    _PASS.depth = getattr(_PASS, "depth", 0) + 1
    try:
        yield
    finally:
        _PASS.depth -= 1


def _float32(device_type: str) -> autocast:
    """A disabled region without rules: float32 whatever region the caller is in."""
    return autocast(device_type, enabled=False, policy=_NO_RULES)


_NO_RULES = Policy()


def isolated(engine: Engine, subject: Subject, cand: Candidate) -> Measurement:
    """Run ``subject`` alone in ``cand`` (the rest in float32) and compare with the reference."""
    tap = Tap(subject.module, against=subject.record, scale=engine.scale)
    stats = Fp8Stats() if cand.recipe is not None else None
    make = cand.isolated(subject.module, subject.name, engine.device_type, engine.job.region, stats)
    grads = engine.run(f"{subject.name} in {cand.word}", [tap], isolate=(subject.module, make))
    has_input_grads = subject.record.has_input_grad
    weight = engine.subset_power(grads, subject.param_index) if subject.param_index else None
    return Measurement(
        candidate=cand.word,
        model_grad_sqnr=engine.model_power(grads).sqnr,
        output_sqnr=tap.comparison.output.sqnr,
        input_grad_sqnr=tap.comparison.input_grad.sqnr if has_input_grads else None,
        weight_grad_sqnr=None if weight is None else weight.sqnr,
        fp8=None if stats is None else stats.read().get(subject.name),
    )


def with_policy(engine: Engine, label: str, policy: Policy | None) -> float:
    """Whole-model gradient SQNR with the model in the region under ``policy``."""
    device_type, dtype = engine.device_type, engine.job.region

    def region() -> autocast:
        return autocast(device_type, dtype=dtype, policy=policy or _NO_RULES)

    return engine.model_power(engine.run(label, region=region)).sqnr


def fp16_ranges(engine: Engine, subjects: Sequence[Subject]) -> dict[str, Fp16Range | None]:
    """With float16 in play: the proposed loss scale (every later pass uses it) and each
    subject's range figures; else no figures and no scale."""
    if not uses_fp16(engine.job):
        return dict.fromkeys((t.name for t in subjects), None)
    engine.scale = propose_scale(subjects, engine.reference)
    return {t.name: _range(t, engine) for t in subjects}


def _range(t: Subject, engine: Engine) -> Fp16Range:
    record = t.record
    grads = [engine.reference[i] for i in t.param_index]
    for calls in (record.output_grads, record.input_grads):
        grads += [g for call in calls for g in call]
    return fp16_range([o for call in record.outputs for o in call], grads, engine.scale)


def uses_fp16(job: Job) -> bool:
    """Whether float16 is the region's dtype or a candidate (loss scaling matters)."""
    return job.region == torch.float16 or any(c.is_fp16 for c in job.candidates)
