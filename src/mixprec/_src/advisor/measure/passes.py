"""The passes: the engine that runs and counts them, the float32 reference and what it tells of
float16's range (the proposed loss scale, each module's values out of range or flushed), the
region under a policy (one module alone in a candidate: :mod:`.alone`).

Every pass runs the loss function on every batch, then backward (of the loss times the loss scale
when float16 is involved), then takes the parameters' gradients. Between passes the
:class:`~mixprec._src.advisor.measure.guard.Guard` resets gradients, buffers and RNG state, so
every pass starts from the same state and sees the same random numbers. Every pass runs in a
disabled region without a policy, so that the reference is float32 (and a module's isolated
pass runs only its own region) also where ``advise`` or ``Watch.step`` is called inside an
autocast region, with grad on also where it is called under ``torch.no_grad()`` or
``torch.inference_mode()``, and a module compiled in place (``Module.compile()``) runs its
eager forward; the caller's state is back in force when the pass ends.

A tap (a pair of forward hooks on one module) sees every call of its module: the floating
outputs, the gradient of the module's floating inputs (each input is replaced by an alias,
``t.view_as(t)``, so that the gradient recorded is the one flowing through this module only, not
through a residual branch that shares the tensor), and, in the reference pass, the gradient of
the outputs.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec._src.advisor.arguments import LOSS_FORM, Candidate
from mixprec._src.advisor.measure.guard import Guard
from mixprec._src.advisor.measure.metrics import Power
from mixprec._src.advisor.report.advice import Fp16Range
from mixprec._src.advisor.speed.model import FlopCount, counting
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.region import autocast
from mixprec._src.torch_compat import compiled_runs_eagerly, tree_flatten, tree_map
from mixprec.errors import ConfigError

#: Powers of two of headroom between the largest reference gradient times the proposed initial
#: scale and the float16 maximum (gradients grow during training; the scaler grows the scale).
SCALE_HEADROOM = 2.0**4
SCALE_RANGE = (2.0**-24, 2.0**24)
#: The largest finite float16 value.
FP16_MAX = 65504.0
#: The smallest magnitude that float16 rounds to infinity (65504 plus half an ulp; ties go to the
#: even mantissa, which is infinity's).
FP16_OVERFLOW = 65520.0

Progress = Callable[[int, int, str], None]


_SEQUENCE = itertools.count()


def _floating(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


class Record:
    """What the reference pass saw of one module, call by call (float32 copies)."""

    def __init__(self) -> None:
        self.input_grads: list[list[torch.Tensor | None]] = []
        self.outputs: list[list[torch.Tensor]] = []
        self.output_grads: list[list[torch.Tensor | None]] = []
        self.first_call = -1  # when it first ran, relative to other records (execution order)

    @property
    def calls(self) -> int:
        return len(self.outputs)

    @property
    def input_grad_calls(self) -> list[bool]:
        """Per call, whether an input needed a gradient (the call ran an input-gradient GEMM)."""
        return [any(g is not None for g in call) for call in self.input_grads]

    @property
    def has_input_grad(self) -> bool:
        """Whether an input of the module needed a gradient in any call."""
        return any(self.input_grad_calls)


class Comparison:
    """Errors of one module's tensors against its :class:`Record`, summed over its calls."""

    def __init__(self) -> None:
        self.output = Power()
        self.input_grad = Power()


class Tap:
    """Hooks on one module: record into ``record`` or, when ``against`` is given, compare.

    ``scale`` is the loss scale of the pass (gradients are divided by it before comparing);
    ``shapes_only``: record the tensors' shapes (as meta tensors), not their values.
    """

    def __init__(
        self,
        module: nn.Module,
        against: Record | None = None,
        scale: float = 1.0,
        shapes_only: bool = False,
    ) -> None:
        self.module = module
        self.against = against
        self.scale = scale
        self.shapes_only = shapes_only
        self.record = Record()
        self.comparison = Comparison()
        self._call = 0
        self._handles: list[Any] = []

    def attach(self) -> None:
        self._handles = [
            self.module.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.module.register_forward_hook(self._post),
        ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        call = self._call
        slots: list[torch.Tensor | None] = []
        if self.against is None:
            self.record.input_grads.append(slots)

        def alias(t: Any) -> Any:
            if not (_floating(t) and t.requires_grad):
                return t
            index = len(slots)
            slots.append(None)
            view = t.view_as(t)
            view.register_hook(self._input_grad_hook(call, index, slots))
            return view

        return tree_map(alias, (args, kwargs))

    def _input_grad_hook(
        self, call: int, index: int, slots: list[torch.Tensor | None]
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.shapes_only:
                slots[index] = grad.detach().to("meta")
                return
            g = grad.detach().float() / self.scale
            if self.against is None:
                _accumulate(slots, index, g)
            elif call < self.against.calls and index < len(self.against.input_grads[call]):
                self.comparison.input_grad.add(g, self.against.input_grads[call][index])

        return hook

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        call = self._call
        self._call += 1
        outs = [t for t in tree_flatten(output)[0] if _floating(t)]
        if self.against is not None:
            if call < self.against.calls:
                self.comparison.output.add_all(
                    [o.detach().float() for o in outs], self.against.outputs[call]
                )
            return
        if call == 0:
            self.record.first_call = next(_SEQUENCE)
        if self.shapes_only:
            self.record.outputs.append([o.detach().to("meta") for o in outs])
            return
        self.record.outputs.append([o.detach().float().clone() for o in outs])
        grads: list[torch.Tensor | None] = [None] * len(outs)
        self.record.output_grads.append(grads)
        for i, o in enumerate(outs):
            if o.requires_grad:
                o.register_hook(_store_into(grads, i))


def _store_into(slots: list[torch.Tensor | None], index: int) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        _accumulate(slots, index, grad.detach().float())

    return hook


def _to_float32(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16):
        return t.float()
    return t


def _accumulate(slots: list[torch.Tensor | None], index: int, grad: torch.Tensor) -> None:
    old = slots[index]
    slots[index] = grad.clone() if old is None else old + grad


@contextmanager
def attached(taps: list[Tap]) -> Iterator[None]:
    """Attach every tap for the duration of a pass."""
    try:
        for tap in taps:
            tap.attach()
        yield
    finally:
        for tap in taps:
            tap.detach()


@contextmanager
def around(module: nn.Module, make: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
    """Run ``module``'s forward inside a fresh context from ``make()`` (entered by a pre-hook,
    left by an always-called post-hook); its 16-bit outputs are cast to float32, the dtype the
    rest of the model runs in during an isolated pass (the values are unchanged)."""
    stack: list[AbstractContextManager[Any]] = []

    def pre(mod: nn.Module, args: Any) -> None:
        ctx = make()
        ctx.__enter__()
        stack.append(ctx)

    def post(mod: nn.Module, args: Any, output: Any) -> Any:
        if stack:
            stack.pop().__exit__(None, None, None)
        return tree_map(_to_float32, output)

    handles = [
        module.register_forward_pre_hook(pre, prepend=True),
        module.register_forward_hook(post, always_call=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while stack:
            stack.pop().__exit__(None, None, None)


@dataclass
class Subject:
    """One measured module and what the reference pass recorded of it: its tensors and its
    GEMMs (all the speed model needs of it)."""

    name: str
    module: nn.Module
    param_index: list[int]
    serving: tuple[Candidate, ...] = ()
    why_not: str = ""
    record: Record = field(default_factory=Record)
    tied: bool = False  # it holds a parameter another module holds too


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
        with ExitStack() as stack:
            stack.enter_context(_passing())
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(compiled_runs_eagerly())
            self.guard.reset()
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

    def run_reference(
        self, subjects: Sequence[Subject], flops: FlopCount | None = None, shapes_only: bool = False
    ) -> None:
        """The float32 pass: records every subject (only its shapes with ``shapes_only``), and
        counts the matmul FLOP into ``flops``; raises if it is not finite."""
        taps = [Tap(t.module, shapes_only=shapes_only) for t in subjects]
        grads = self.run("float32 reference", taps, outer=counting(flops))
        for subject, tap in zip(subjects, taps, strict=True):
            subject.record = tap.record
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


def fp16_figures(engine: Engine, subjects: Sequence[Subject]) -> dict[str, Fp16Range | None]:
    """With float16 in play (the region's dtype or a candidate), the proposed loss scale, set
    on ``engine`` (every later pass runs at it), and each subject's float16 range figures from
    the reference pass; else no figures. Host sync: several per subject."""
    if not uses_fp16(engine.job):
        return {s.name: None for s in subjects}
    engine.scale = propose_scale(subjects, engine.reference)
    return {s.name: _fp16_range(s, engine.reference, engine.scale) for s in subjects}


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


def _fp16_overflows(t: torch.Tensor, scale: float = 1.0) -> int:
    """How many values of ``t * scale`` float16 rounds to infinity. Host sync: one."""
    return int((t.detach().abs().float() * scale >= FP16_OVERFLOW).sum())


def _fp16_flushed(t: torch.Tensor, scale: float = 1.0) -> tuple[int, int]:
    """(non-zero values of ``t * scale`` that float16 rounds to zero, non-zero values).

    ``scale`` is a power of two, so ``t * scale`` is exact in float32. Host sync: one.
    """
    scaled = t.detach().float() * scale
    nonzero = scaled != 0
    flushed = nonzero & (scaled.to(torch.float16) == 0)
    return int(flushed.sum()), int(nonzero.sum())


def _fp16_range(
    subject: Subject, reference: Sequence[torch.Tensor | None], scale: float
) -> Fp16Range:
    """How a module's reference outputs and gradients (of its parameters, output and inputs)
    fit float16, unscaled and at the loss ``scale``."""
    record = subject.record
    outputs = [o for call in record.outputs for o in call]
    grads = [reference[i] for i in subject.param_index]
    for calls in (record.output_grads, record.input_grads):
        grads += [g for call in calls for g in call]
    present = [g for g in grads if g is not None and g.numel()]
    flushed = [0, 0, 0]  # unscaled, scaled, non-zero
    overflow = 0
    for g in present:
        a, n = _fp16_flushed(g)
        b, _ = _fp16_flushed(g, scale)
        flushed[0], flushed[1], flushed[2] = flushed[0] + a, flushed[1] + b, flushed[2] + n
        overflow += _fp16_overflows(g, scale)
    nonzero = max(flushed[2], 1)
    return Fp16Range(
        output_overflow=sum(_fp16_overflows(o) for o in outputs),
        output_max=max((float(o.abs().max()) for o in outputs if o.numel()), default=0.0),
        grad_max=max((float(g.abs().max()) for g in present), default=0.0),
        flushed_unscaled=flushed[0] / nonzero,
        flushed_scaled=flushed[1] / nonzero,
        grad_overflow_scaled=overflow,
    )


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


def with_policy(engine: Engine, label: str, policy: Policy | None) -> float:
    """Whole-model gradient SQNR with the model in the region under ``policy``."""
    device_type, dtype = engine.device_type, engine.job.region

    def region() -> autocast:
        return autocast(device_type, dtype=dtype, policy=policy or _NO_RULES)

    return engine.model_power(engine.run(label, region=region)).sqnr


def uses_fp16(job: Job) -> bool:
    """Whether float16 is the region's dtype or a candidate (loss scaling matters)."""
    return job.region == torch.float16 or any(c.is_fp16 for c in job.candidates)
