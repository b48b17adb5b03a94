"""``mixprec.Watch``: re-measure a proposed policy during training, warn when it goes stale.

A policy chosen at step 0 can go stale: activations grow outliers (massive activations on a few
tokens, SwiGLU amplifying channels), a tensor's fp8 scale is then set by a few huge values and
the rest loses its bits. Every ``every`` steps the watch runs the advisor's passes on a few
modules (``sample`` of them, taken in turn, plus any module with an alert) on that step's batch:
one float32 reference pass, then each sampled module alone in its chosen precision and, the first
time and whenever that figure fell more than ``tolerance`` dB since, alone in the region's 16-bit
dtype. It records per module the whole-model gradient SQNR of both and, for fp8, the saturated
and flushed fractions of its operands.

A whole-model gradient SQNR falls during ordinary training (as the loss converges, the gradient
becomes a sum of contributions that cancel, while rounding errors do not), for bf16 as for fp8;
what signals a stale policy is the candidate losing ground against bf16 at the same step. An
alert is raised when a module's margin over its 16-bit figure falls more than ``tolerance`` dB
below its margin when the watch first measured it, when its candidate gives inf/NaN, or when
its fp8 clipped or flushed fraction rises above ``rise`` times its figure in the advice (plus
0.1%). Clipped counts what clips: the blocks whose scale hit the top of its format (values at
the format's maximum after rounding are not clipped: a scale from the amax, or its power of
two, never clips). Outliers that set a tensor's scale flush the other values long before an
SQNR dominated by the outliers themselves moves. An alert is a
:class:`~mixprec.errors.MixprecWarning` naming the module and the updated proposal (the
advice's figures with each module's loss of margin); ``hook`` sees every check (TensorBoard:
``TensorBoardHook.record_watch``).

A module that loses ground against 16-bit also gets a phase switch proposed: the policy in force
with its fprop matmul in the region's 16-bit dtype (late in training the forward is where low
precision costs most: arXiv 2509.25149, Appendix D). Given the :class:`~mixprec.Schedule` the
loop trains with, the watch measures each module's rule in force and, with ``apply=True``,
applies the switch from the next step on and logs what changed.
"""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from mixprec._src.advisor.arguments import (
    Candidate,
    check_model,
    device_of,
    parse_candidates,
    region_dtype,
)
from mixprec._src.advisor.choose.options import PerMatmul, module_choice
from mixprec._src.advisor.choose.policy import build_policy, forward_high
from mixprec._src.advisor.choose.search import Target, search
from mixprec._src.advisor.measure.alone import isolated
from mixprec._src.advisor.measure.guard import Guard
from mixprec._src.advisor.measure.metrics import db_to_ratio, ratio_to_db
from mixprec._src.advisor.measure.passes import Engine, Job, Subject, in_pass
from mixprec._src.advisor.report.advice import Advice, Measurement, ModuleAdvice
from mixprec._src.advisor.report.watch import (
    WatchRecord,
    WatchReport,
    clipped,
    flushed,
    message,
    record,
)
from mixprec._src.advisor.speed.gpus import get_gpu
from mixprec._src.advisor.speed.model import BF16, Operands, predict, time_budget
from mixprec._src.autocast.calls import region_policy
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.rules import format_dtype
from mixprec._src.autocast.schedule import Schedule
from mixprec._src.autocast.tree import rule_of
from mixprec._src.torch_compat import mark_constant
from mixprec.errors import ConfigError, MixprecWarning

_LOG = logging.getLogger("mixprec")

#: A rise of a saturated or flushed fraction counts only above this (one value in a thousand).
FRACTION_FLOOR = 1e-3


class Watch:
    """Re-measure an :class:`~mixprec.types.Advice`'s policy every ``every`` training steps.

    Args:
        model: the model the advice was made for (trained in place).
        loss_fn: ``loss_fn(model, batch)``, as for :func:`mixprec.advise`.
        advice: what :func:`mixprec.advise` returned for this model.
        every: steps between checks (a check costs ``1 + sample`` forward+backward passes, and
            one more for a module whose SQNR fell more than ``tolerance`` since it was last
            compared with 16-bit).
        sample: modules measured per check, in turn (modules with an alert are added).
        tolerance: dB a module's candidate may lose against 16-bit since the watch first
            measured it.
        rise: how many times its fraction in the advice an fp8 module's saturated or flushed
            fraction may reach (plus 0.1%) before an alert.
        hook: called with every :class:`WatchReport`.
        schedule: the :class:`~mixprec.Schedule` the loop trains with (``schedule.at(step)``):
            the watch measures each module's rule in force at the check's step instead of the
            advice's choice, and expects the loop to train its policies.
        apply: apply a proposed switch (:attr:`WatchReport.switch`) to ``schedule`` from the
            next step on, in the current phase and every later one, and log what changed (the
            ``"mixprec"`` logger, and the alert's warning).
        start_step: the loop's step the watch starts at (the step whose forward runs next, as
            ``schedule.at(step)`` counts): a run resumed at step 6000 passes 6000, so that its
            checks fall on the loop's steps and measure the phase it trains. ``step(step=...)``
            sets the count at each call instead.

    Raises:
        ConfigError: a bad argument, or an advice whose modules the model does not have.

    Example:
        >>> import torch, mixprec, warnings
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 1))
        >>> batch = (torch.randn(32, 8), torch.randn(32, 1))
        >>> loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        >>> advice = mixprec.advise(model, batch, loss, candidates=["fp8"])
        >>> watch = mixprec.Watch(model, loss, advice, every=2, sample=1)
        >>> watch.step(batch) is None, watch.step() is not None
        (True, True)
        >>> [r.name for r in watch.history()]
        ['0']

    Host sync: none between checks; a check reads its figures back.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], Any],
        advice: Advice,
        *,
        every: int = 100,
        sample: int = 1,
        tolerance: float = 6.0,
        rise: float = 2.0,
        hook: Callable[[WatchReport], object] | None = None,
        schedule: Schedule | None = None,
        apply: bool = False,
        start_step: int = 0,
    ) -> None:
        _check(model, loss_fn, advice, (every, sample), (tolerance, rise), hook)
        _loop_step(start_step, "start_step")
        _check_schedule(schedule, apply)
        self.schedule, self.apply = schedule, apply
        self.model, self.loss_fn, self.advice = model, loss_fn, advice
        self.every, self.sample = every, sample
        self.tolerance, self.rise, self.hook = tolerance, rise, hook
        names = dict(model.named_modules())
        self._watched = [m for m in advice.modules if m.served and _watchable(m)]
        self._modules = {m.name: names[m.name] for m in self._watched}
        self._trained = _TrainedPolicies(model)
        self._warned: set[Policy | None] = set()
        # Per (module, what it ran in): a rule the schedule changes starts a baseline of its own.
        self._margins: dict[tuple[str, str], float] = {}  # the first margin measured
        self._level: dict[tuple[str, str], float] = {}  # the SQNR when last compared with 16-bit
        self._lost: dict[tuple[str, str], float] = {}  # dB of margin lost since the first
        self._fractions: dict[tuple[str, str], tuple[float | None, float | None]] = {}
        self._flagged: set[str] = set()
        self._blind_warned = False
        self._lost_ground: set[str] = set()  # modules whose last margin alert stands
        self._records: list[WatchRecord] = []
        self._steps = start_step  # the steps trained: the loop's next step (one count)
        self._turn = 0
        self._batch: Any = None
        self.last: WatchReport | None = None

    def step(self, batch: Any = None, *, step: int | None = None) -> WatchReport | None:
        """Count a training step; at every ``every``-th, check on ``batch`` (default: the last
        batch passed) and return the :class:`WatchReport`, else None.

        Call it after the optimizer step. ``step`` is the loop's step just trained (the number
        it gave ``schedule.at(step)``): the watch takes the loop's count instead of counting its
        calls from ``start_step``, so a resumed or skipping loop is checked at its own steps and
        measured in the phase it trains; a check is due when ``step + 1`` is a multiple of
        ``every``. The model's parameters, buffers, ``.grad``, training
        flags and RNG state are left as they were. When the model's training forwards since the
        last step ran under a policy other than the advice's (or outside any mixprec region),
        it warns once per such policy: the watch measures the advice's choices, not what the
        loop trains. A compiled loop's policy is noticed when its graph is made; where torch
        does not recompile for a hook added later, a model compiled before the watch began
        runs without the watch's hook, and the first check warns that no training forward was
        seen.

        Raises:
            ConfigError: a check is due and no batch was ever passed, a watched module is no
                longer the model's (replaced or removed since the advice), or ``step`` is not
                an int >= 0.

        Host sync: none between checks; a check reads its figures back.
        """
        self._steps = self._steps + 1 if step is None else _loop_step(step, "step") + 1
        if batch is not None:
            self._batch = batch
        self._notice_other_policy()
        if self._steps % self.every or not self._watched:
            return None
        if self._batch is None:
            raise ConfigError("Watch.step() has no batch to check on: pass the step's batch")
        report = self._check(self._batch)
        self._notice_unseen()
        if report.switch is not None and self.apply:
            report = replace(report, applied=tuple(self._apply(report.records)))
        self.last = report
        if report.alerts:
            warnings.warn(message(report), MixprecWarning, stacklevel=2)
        if self.hook is not None:
            self.hook(report)
        return report

    def history(self) -> list[WatchRecord]:
        """Every record so far, in the order measured. Host sync: none."""
        return list(self._records)

    def _picked(self) -> list[ModuleAdvice]:
        rows = [m for m in self._watched if m.name in self._flagged]
        for _ in range(len(self._watched)):
            if len(rows) >= self.sample + len(self._flagged):
                break
            row = self._watched[self._turn % len(self._watched)]
            self._turn += 1
            if row not in rows:
                rows.append(row)
        return rows

    def _check(self, batch: Any) -> WatchReport:
        rows = self._picked()
        records = self._measure(rows, batch)
        alerts = []
        for rec in records:
            self._lost_ground.discard(rec.name)
            problem = self._problem(rec, _row(self.advice, rec.name))
            (self._flagged.add if problem else self._flagged.discard)(rec.name)
            if problem:
                alerts.append(problem)
        self._records += records
        policy = self._proposal() if alerts else None
        switch, _ = self._switched(self._in_force(), records)
        predicted = self._predicted()
        return WatchReport(self._steps, tuple(records), predicted, tuple(alerts), policy, switch)

    def _in_force(self) -> Policy | None:
        """The policy the loop trains at the check's step (the advice's without a schedule)."""
        if self.schedule is None:
            return self.advice.policy
        return self.schedule.at(max(self._steps - 1, 0))

    def _switched(
        self, policy: Policy | None, records: Sequence[WatchRecord]
    ) -> tuple[Policy | None, list[str]]:
        """``policy`` with the fprop of each module that lost ground against 16-bit in 16-bit,
        and what changed; (None, []) when nothing would."""
        lost = [r.name for r in records if r.name in self._lost_ground]
        if policy is None or not lost:
            return None, []
        high = format_dtype(self.advice.dtype)
        switched, changes = forward_high(policy, self.model, lost, high)
        return (switched, changes) if changes else (None, [])

    def _apply(self, records: Sequence[WatchRecord]) -> list[str]:
        """The switch, from the next step on, in the phase in force and every later one."""
        assert self.schedule is not None
        start, applied = self._steps, []
        later = [(s, p) for s, p in self.schedule.phases if s > start]
        for first, policy in [(start, self.schedule.at(start)), *later]:
            switched, changes = self._switched(policy, records)
            if switched is not None:
                self.schedule.switch(first, switched)
                applied += [f"{c} from step {first}" for c in changes]
        for line in applied:
            _LOG.warning("mixprec.Watch applied: %s", line)
        return applied

    def _measure(self, rows: Sequence[ModuleAdvice], batch: Any) -> list[WatchRecord]:
        advice, model = self.advice, self.model
        device = device_of(model)
        cands = parse_candidates(list(advice.candidates), device.type)
        job = Job(model, [batch], self.loss_fn, device, cands, region_dtype(cands))
        position = {id(p): i for i, p in enumerate(model.parameters())}
        subjects = []
        for r in rows:
            module = self._current(r.name)
            subjects.append(
                Subject(r.name, module, sorted({position[id(p)] for p in module.parameters()}))
            )
        high = Candidate(format_dtype(job.region), job.region)
        with Guard(model, device) as guard:
            engine = Engine(job, guard)
            engine.run_reference(subjects)
            engine.scale = advice.init_scale or 1.0
            found = []
            for s, r in zip(subjects, rows, strict=True):
                cand = self._candidate(r)
                if cand is None:
                    continue  # the schedule runs it in no low precision now: nothing to watch
                got = isolated(engine, s, cand)
                ref = isolated(engine, s, high) if self._needs_reference(r, cand, got) else None
                found.append(record(self._steps, r, got, ref))
        return found

    def _candidate(self, row: ModuleAdvice) -> Candidate | None:
        """What the module runs in at this check: the advice's choice, or with a schedule the
        rule in force (None: not a low precision)."""
        if self.schedule is None:
            return Candidate.of(row.choice)
        policy = self._in_force()
        module = self._modules[row.name]
        rule = None if policy is None else rule_of(self.model, policy, module)
        try:
            return None if rule is None else Candidate.of(str(rule).partition("@")[0])
        except ConfigError:
            return None

    def _current(self, name: str) -> nn.Module:
        """The watched module ``name``, still the one the advice measured."""
        module = dict(self.model.named_modules()).get(name)
        if module is self._modules[name]:
            return module
        what = "removed from the model" if module is None else "replaced by another module"
        raise ConfigError(
            f"the watched module {name!r} was {what} since the advice: its figures no longer "
            "describe the model; advise the model again (mixprec.advise) and watch the new advice"
        )

    def _notice_other_policy(self) -> None:
        """Warn once per policy the loop trains other than the advice's."""
        planned = [] if self.schedule is None else [p for _, p in self.schedule.phases]
        for policy in self._trained.take():
            if policy == self.advice.policy or policy in planned or policy in self._warned:
                continue
            self._warned.add(policy)
            what = "outside any mixprec.autocast policy" if policy is None else f"{str(policy)!r}"
            warnings.warn(
                f"mixprec.Watch: the model trains under {what}, not the advice's policy "
                f"{str(self.advice.policy)!r}; the watch measures the advice's choices: train "
                "with advice.policy, or watch the advice made for the policy you train",
                MixprecWarning,
                stacklevel=3,
            )

    def _notice_unseen(self) -> None:
        """Warn once, at the first check, if no training forward of the model was seen: the
        watch cannot tell which policy the loop trains."""
        if self._trained.ever or self._blind_warned:
            return
        self._blind_warned = True
        warnings.warn(
            f"mixprec.Watch saw no training forward of the model (train mode, grad on) in "
            f"{self._steps} steps, so it cannot tell which policy the loop trains: a model "
            "compiled before the Watch was made runs its compiled graph without the watch's "
            "forward pre-hook. Make the Watch before compiling the model (or before its first "
            "compiled call); the watch measures the advice's choices either way",
            MixprecWarning,
            stacklevel=3,
        )

    def _needs_reference(self, row: ModuleAdvice, cand: Candidate, got: Measurement) -> bool:
        """The 16-bit pass is run the first time a module in a recipe is measured, and when
        its SQNR fell more than ``tolerance`` since: it tells the module's own loss from the
        whole gradient's drift."""
        if cand.dtype is not None or got.model_grad_sqnr == -math.inf:
            return False
        level = self._level.get((row.name, cand.word))
        return level is None or got.model_grad_sqnr < level - self.tolerance

    def _problem(self, rec: WatchRecord, row: ModuleAdvice) -> str | None:
        if rec.model_grad_sqnr == -math.inf:
            return f"{rec.name} ({rec.candidate}) gives inf/NaN"
        key, margin = (rec.name, rec.candidate), rec.margin
        if margin is not None:
            first = self._margins.setdefault(key, margin)
            self._level[key] = rec.model_grad_sqnr
            self._lost[key] = max(0.0, margin - first)
            if margin - first > self.tolerance:
                self._lost_ground.add(rec.name)
                return (
                    f"{rec.name} ({rec.candidate}) is {margin:.1f} dB below bf16 at this step, "
                    f"{first:.1f} dB when first measured"
                )
        base, where = self._fraction_base(rec, row)
        for what, now, was in (
            ("clips", rec.clipped, base[0]),
            ("flushes to 0", rec.flushed, base[1]),
        ):
            if now is not None and was is not None and now > self.rise * was + FRACTION_FLOOR:
                return (
                    f"{rec.name} ({rec.candidate}) {what} {100 * now:.2g}% of an operand's "
                    f"{'blocks' if what == 'clips' else 'values'}, {100 * was:.2g}% {where}"
                )
        return None

    def _fraction_base(
        self, rec: WatchRecord, row: ModuleAdvice
    ) -> tuple[tuple[float | None, float | None], str]:
        """What a module's clipped and flushed fractions are compared with: the advice's
        figures for what it runs in, else (a mix of recipes, a rule of the schedule the advice
        did not measure) the watch's first figures for it."""
        before = row.measurement(rec.candidate)
        if before is not None and before.fp8 is not None:
            return (clipped(before), flushed(before)), "in the advice"
        key = (rec.name, rec.candidate)
        return self._fractions.setdefault(key, (rec.clipped, rec.flushed)), "when first measured"

    def _ratio(self, row: ModuleAdvice) -> float:
        chosen = row.measurement(row.choice)
        db = chosen.model_grad_sqnr if chosen is not None else math.inf
        return db_to_ratio(db - self._lost.get((row.name, row.choice), 0.0))

    def _predicted(self) -> float:
        advice = self.advice
        noise = db_to_ratio(advice.region_sqnr)
        for row in advice.modules:
            if not row.served:
                continue
            if row in self._watched:
                noise += self._ratio(row)
            elif row.kept_measurement is not None:
                noise += db_to_ratio(row.kept_measurement.model_grad_sqnr)
        return ratio_to_db(noise)

    def _proposal(self) -> Policy | None:
        """The advisor's search, with the advice's objective and GPU, on the advice's figures
        with each module's loss of margin (a module with an alert cannot keep its choice)."""
        advice = self.advice
        served = [m for m in advice.modules if m.served]
        gpu = None if advice.gpu is None else get_gpu(advice.gpu)
        choices = [
            module_choice(
                m.name,
                m.measurements,
                (advice.kept_precision, m.kept_measurement, m.kept_time),
                gpu,
                adjust=self._lowered(m),
                per_matmul=_per_matmul(advice, m, device_of(self.model)),
            )
            for m in served
        ]
        target = Target(advice.min_sqnr, advice.keep_at_most, advice.objective, _budget(advice))
        found = search(choices, db_to_ratio(advice.region_sqnr), target)
        picked = {c.name: c.current.word for c in found.choices}
        names = [m.name for m in served]
        policy = build_policy(self.model, picked, format_dtype(advice.dtype), names)
        return None if policy == advice.policy else policy

    def _lowered(self, row: ModuleAdvice) -> Callable[[str, float], float]:
        """An option's SQNR with the margin the module lost since (its chosen option only; an
        option with an alert is no option)."""
        lost, flagged = self._lost.get((row.name, row.choice), 0.0), row.name in self._flagged

        def adjust(word: str, db: float) -> float:
            if word != row.choice:
                return db
            return -math.inf if flagged else db - lost

        return adjust


def _budget(advice: Advice) -> float | None:
    """The advice's time budget for its served modules (``min_speedup``), as advise set it."""
    if advice.min_speedup is None or advice.step is None or advice.gpu is None:
        return None
    gpu, bf16 = get_gpu(advice.gpu), Operands.uniform(BF16)
    times = [predict(gpu, m.gemms, bf16) for m in advice.modules if m.served]
    searched = sum(t.total for t in times if t is not None)
    return time_budget(advice.step.baseline, searched, advice.min_speedup)


def _watchable(row: ModuleAdvice) -> bool:
    """A module in a measured candidate or a mix of them (not kept)."""
    return row.choice in row.candidates or row.chosen is not None


def _per_matmul(advice: Advice, row: ModuleAdvice, device: torch.device) -> PerMatmul | None:
    if not advice.per_matmul:
        return None
    return PerMatmul(format_dtype(advice.dtype), advice.dtype, row.gemms, device)


class _TrainedPolicies:
    """The policies the model's training forwards ran under: a forward pre-hook on the model
    (a plain object, so that the model still pickles) that asks autocast; the advisor's own
    passes are not training. The hook goes when the watch does."""

    def __init__(self, model: nn.Module) -> None:
        self._probe = _PolicyProbe()
        self._handle = model.register_forward_pre_hook(self._probe)
        self.ever = False  # a training forward (or a compiled graph of one) was seen
        weakref.finalize(self, self._handle.remove)

    def take(self) -> list[Policy | None]:
        found = list(self._probe.seen)
        self._probe.seen.clear()
        self.ever = self.ever or bool(found)
        return found


class _PolicyProbe:
    """Notes the policy of each training forward. Under ``torch.compile`` Dynamo runs
    :func:`_note` once per graph, at trace time (it is marked constant), and guards on its
    arguments: a policy the compiled loop trains under is noted when its graph is made, and
    the compiled code does nothing more (no graph break, also under ``fullgraph=True``)."""

    def __init__(self) -> None:
        self.seen: dict[Policy | None, None] = {}

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling() and in_pass():
            return
        if module.training and torch.is_grad_enabled():
            inside, policy = region_policy()
            _note(self, policy if inside else None)


def _note(probe: _PolicyProbe, policy: Policy | None) -> None:
    probe.seen[policy] = None


mark_constant(_note)


def _check(
    model: object,
    loss_fn: object,
    advice: object,
    counts: tuple[object, object],
    limits: tuple[object, object],
    hook: object,
) -> None:
    check_model(model)
    if not callable(loss_fn):
        raise ConfigError("loss_fn must be callable as loss_fn(model, batch)")
    if not isinstance(advice, Advice):
        raise ConfigError(
            f"advice must be what mixprec.advise returned, got {type(advice).__name__}"
        )
    for name, value in zip(("every", "sample"), counts, strict=True):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    for name, value in zip(("tolerance", "rise"), limits, strict=True):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
    if hook is not None and not callable(hook):
        raise ConfigError(f"hook must be None or a function of a WatchReport, got {hook!r}")
    if any(math.isnan(x.model_grad_sqnr) for m in advice.modules for x in m.measurements):
        raise ConfigError(
            "the advice has no per-module figures to watch (objective='speed' without a "
            "target measures the fastest policy once): advise with min_sqnr or keep_at_most"
        )
    assert isinstance(model, nn.Module)  # check_model raised otherwise
    named = dict(model.named_modules())
    missing = [m.name for m in advice.modules if m.name not in named]
    if missing:
        raise ConfigError(f"the advice names modules the model does not have: {missing[:5]}")


def _loop_step(step: object, name: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(
            f"{name} must be the training loop's step, an int >= 0 (as schedule.at(step) "
            f"takes), got {step!r}"
        )
    return step


def _check_schedule(schedule: object, apply: object) -> None:
    if schedule is not None and not isinstance(schedule, Schedule):
        raise ConfigError(
            f"schedule must be a mixprec.Schedule or None, got {type(schedule).__name__}"
        )
    if not isinstance(apply, bool):
        raise ConfigError(f"apply must be True or False, got {apply!r}")
    if apply and schedule is None:
        raise ConfigError(
            "apply=True needs schedule=: the mixprec.Schedule the loop takes its policy from "
            "(schedule.at(step)), to which the watch applies a switch"
        )


def _row(advice: Advice, name: str) -> ModuleAdvice:
    return next(m for m in advice.modules if m.name == name)
