"""``mixprec.advise``: measure every module in every candidate precision, propose the policy.

In order: the float32 reference pass (which also records each module's GEMM shapes, all the
speed model needs), each module alone in each candidate, the region with every measured module
in float32, every module in its cheapest candidate (the additive model's own check), the
search (around fp8, each module it keeps is measured in the region's dtype and the search
redone), the policy, and with ``check`` the policy measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from mixprec._src.advisor.arguments import (
    Candidate,
    Chosen,
    check_args,
    check_float32,
    check_loss_signature,
    check_speedup,
    choose_modules,
    device_of,
    high_word,
    parse_candidates,
    region_dtype,
)
from mixprec._src.advisor.choose.cost import cost_key, cost_order
from mixprec._src.advisor.choose.options import PerMatmul, mix_measurement, module_choice
from mixprec._src.advisor.choose.policy import build_policy
from mixprec._src.advisor.choose.search import Proposal, Target, search
from mixprec._src.advisor.measure.alone import isolated, measure_alone, passes_per
from mixprec._src.advisor.measure.guard import Guard
from mixprec._src.advisor.measure.metrics import db_to_ratio, ratio_to_db
from mixprec._src.advisor.measure.passes import (
    Engine,
    Job,
    Progress,
    Subject,
    fp16_figures,
    propose_scale,
    uses_fp16,
    with_policy,
)
from mixprec._src.advisor.report.advice import (
    Advice,
    Cheapest,
    Fp16Range,
    Measurement,
    ModuleAdvice,
)
from mixprec._src.advisor.speed.gpus import GPU, get_gpu
from mixprec._src.advisor.speed.model import (
    BF16,
    FlopCount,
    Gemms,
    Operands,
    StepTime,
    Time,
    counted_flops,
    gemm_shapes,
    predict,
    step_time,
    time_budget,
)
from mixprec._src.advisor.speed.operands import operands
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.rules import format_dtype
from mixprec.errors import ConfigError

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def advise(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    candidates: Sequence[str] | str | None = None,
    min_sqnr: float | None = None,
    keep_at_most: int | None = None,
    modules: Sequence[str | type[nn.Module]] | None = None,
    more_batches: Sequence[Any] = (),
    check: bool = False,
    progress: Progress | None = None,
    gpu: str | None = None,
    objective: str = "fewest_kept",
    per_matmul: bool = True,
    min_speedup: float | None = None,
) -> Advice:
    """Measure each module's error in each candidate precision and propose a :class:`Policy`.

    Every pass runs in float32 outside the candidates' own regions, with grad on, also when
    ``advise`` is called inside an autocast region or under ``torch.no_grad()`` or
    ``torch.inference_mode()``; a module compiled in place (``Module.compile()``) runs its eager
    forward. Runs a float32 reference forward+backward
    (``loss_fn(model, batch).backward()``), then one pass per module and candidate with only
    that module in the candidate precision, and one pass of the region with every measured
    module in float32 (the error of the ops between them); around fp8, each kept module is also
    measured in the region's dtype. Per module it reports the SQNR of the output, of the input
    and weight gradients and of the whole model's gradient, for float16 the values out of range
    and the gradients that flush to zero with and without loss scaling, for fp8 the saturated
    and flushed fractions of each operand. The proposal keeps the most sensitive modules out of
    the candidates until the predicted whole-model gradient SQNR meets ``min_sqnr`` (or keeps
    the ``keep_at_most`` most sensitive ones). The model's parameters, buffers, ``.grad`` and
    torch's RNG state are left as they were.

    Args:
        model: the model, on the device to measure on.
        batch: one batch, passed to ``loss_fn`` as is.
        loss_fn: ``loss_fn(model, batch)`` returns the scalar loss (it calls the model).
        candidates: rule words, in any order: ``"fp16"``, ``"bf16"``, fp8 recipes
            (``"fp8"``, ``"fp8:rowwise"``, ``"mxfp8"``, ``"nvfp4"``; they serve ``nn.Linear``)
            (default: torch's autocast dtype for the device, e.g. bf16 on the CPU, fp16 on CUDA).
            The advisor orders them by cost: with ``gpu``, each module's predicted time in
            each; else their bits per element (docs/advisor.md, "Which candidate is cheaper").
        min_sqnr: the target: the least whole-model gradient SQNR in dB.
        keep_at_most: the most modules to keep out of every candidate. Without ``min_sqnr``,
            the ``keep_at_most`` most sensitive modules are kept. With neither, only modules
            whose every candidate gives inf/NaN are kept.
        modules: what to measure: qualified-name globs or ``nn.Module`` classes (default: every
            leaf module with trainable parameters except norms and embeddings).
        more_batches: a list of further batches; every pass runs over all of them.
        check: apply the proposal and measure its real SQNR (one more pass).
        progress: called as ``progress(done, total, label)`` after every pass.
        gpu: a GPU for the speed model (``"h100"``, ``"h200"``, ``"h200-nvl"``,
            ``"b200"``, ``"b300"``): each module's predicted time per candidate (its three
            GEMMs and casts, for the shapes of ``batch``) and the step's predicted speedup
            against bf16 (docs/advisor.md says how it is modelled). A recipe the GPU has no
            kernel for is measured (emulated) but never chosen.
        objective: what the search minimises once ``min_sqnr`` is met: ``"fewest_kept"``
            (default: the fewest modules kept, the cheapest candidates) or ``"speed"`` (the
            fastest policy on ``gpu``; needs a ``gpu``); or ``"sqnr"``: the most precise
            policy predicted at least ``min_speedup`` times faster than bf16 on ``gpu``.
            ``"speed"`` without ``min_sqnr`` and ``keep_at_most`` needs no per-module figure:
            the policy the speed model predicts fastest from the reference pass's shapes is
            measured once (two passes in all; each module is measured alone only if that
            policy gives inf/NaN).
        per_matmul: measure each recipe candidate one matmul at a time (two passes per module
            and recipe instead of one: fprop alone, then dgrad and wgrad) and let the search
            give a module's three matmuls each its own format: a recipe or the region's dtype
            (``"nvfp4/nvfp4/bf16"``). ``False``: one pass per module and recipe, and a module's
            matmuls share its choice.
        min_speedup: with ``objective="sqnr"``: the least predicted speedup of the step's
            matmuls against bf16 on ``gpu`` (``Advice.step.speedup``), e.g. ``1.5``.

    Returns:
        An :class:`~mixprec.types.Advice`: the policy, the region dtype, a suggested
        ``GradScaler`` ``init_scale``, the prediction and the per-module figures, with
        ``table()``, ``plot()`` and ``to_json()``.

    Raises:
        ConfigError: a bad argument (before any pass), a model wrapped by ``torch.compile``
            or holding a wrapped module (pass the eager module; before any pass), a model with
            16-bit parameters, a loss function that cannot be called as
            ``loss_fn(model, batch)`` or does not return a scalar loss that requires grad, a
            float32 reference with inf/NaN gradients.

    Example:
        >>> import torch, mixprec
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> x, y = torch.randn(16, 8), torch.randn(16, 1)
        >>> loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]).float(), b[1])
        >>> advice = mixprec.advise(model, (x, y), loss, candidates=["fp16"], keep_at_most=1)
        >>> advice.kept_precision, len(advice.kept)
        ('fp32', 1)
        >>> mixprec.Policy(str(advice.policy)) == advice.policy
        True

    Host sync: many (every pass reads its figures back to the host).
    """
    check_args(model, loss_fn, (min_sqnr, keep_at_most), (check, more_batches, progress), objective)
    if not isinstance(per_matmul, bool):
        raise ConfigError(f"per_matmul must be True or False, got {per_matmul!r}")
    spec = None if gpu is None else get_gpu(gpu)
    if objective in ("speed", "sqnr") and spec is None:
        raise ConfigError(f"objective={objective!r} needs a GPU to predict for, e.g. gpu='h100'")
    check_speedup(min_speedup, objective)
    check_float32(model)
    check_loss_signature(loss_fn, model, batch)
    device = device_of(model)
    cands = cost_order(parse_candidates(candidates, device.type))
    chosen = choose_modules(model, modules, cands)
    job = Job(model, [batch, *more_batches], loss_fn, device, cands, region_dtype(cands), progress)
    goal = Goal(Target(min_sqnr, keep_at_most, objective), spec, check, per_matmul, min_speedup)
    with Guard(model, device) as guard:
        return _advise(job, guard, _subjects(chosen, guard), goal)


@dataclass(frozen=True)
class Goal:
    """What the search aims for, the GPU it predicts for, and whether to check the policy."""

    target: Target
    gpu: GPU | None
    check: bool
    per_matmul: bool = False
    min_speedup: float | None = None


@dataclass
class Found:
    """What the passes measured: per module its float16 range figures, its measurement in each
    serving candidate (with times, with a GPU), its measurement in the kept precision when the
    search kept it around fp8, and its GEMMs."""

    ranges: dict[str, Fp16Range | None]
    alone: dict[str, list[Measurement]]
    kept: dict[str, Measurement]
    gemms: dict[str, Gemms | None] = field(default_factory=dict)
    kept_time: dict[str, Time | None] = field(default_factory=dict)
    flops: FlopCount | None = None


def _subjects(chosen: list[Chosen], guard: Guard) -> list[Subject]:
    position = {id(p): i for i, p in enumerate(guard.params)}
    return [
        Subject(
            c.name,
            c.module,
            sorted({position[id(p)] for p in c.module.parameters()}),
            c.serving,
            c.why_not,
            tied=id(c.module) in guard.tied,
        )
        for c in chosen
    ]


def _planned(subjects: list[Subject], goal: Goal) -> int:
    """The reference, the isolated passes, the region, the cheapest policy and the check (the
    engine is told of kept modules measured around fp8, and of a check it need not run); for
    the fastest policy without a target, the reference and that policy."""
    if _once(goal):
        return 2
    return 1 + _alone_passes(subjects, goal) + 2 + int(goal.check)


def _alone_passes(subjects: list[Subject], goal: Goal) -> int:
    return sum(passes_per(c, goal.per_matmul, s.tied) for s in subjects for c in s.serving)


def _advise(job: Job, guard: Guard, subjects: list[Subject], goal: Goal) -> Advice:
    """Measure, search and report (the model is guarded by the caller)."""
    planned = _planned(subjects, goal)
    flops = FlopCount() if goal.gpu is not None else None
    engine = Engine(job, guard, planned)
    engine.run_reference(subjects, flops, shapes_only=_once(goal))
    ran = sorted((s for s in subjects if s.record.calls), key=lambda s: s.record.first_call)
    served = [s for s in ran if s.serving]
    if _once(goal):
        once = _fastest_once(engine, ran, goal, flops)
        if once is not None:
            return once
    ranges = fp16_figures(engine, served)
    alone = measure_alone(engine, served, goal.per_matmul)
    found = _timed(Found(ranges, alone, {}, flops=flops), ran, job, goal.gpu)
    touched = [s for s in served if found.gemms[s.name] is not None or not _exact(alone[s.name])]
    names = [s.name for s in touched]
    region_sqnr, cheap = _region_and_cheapest(engine, found, names)
    proposal = _choose(engine, touched, found, region_sqnr, goal)
    rows = [_row(job, s, found, proposal, goal) for s in ran]
    picked = {c.name: c.current.word for c in proposal.choices}
    policy = build_policy(job.model, picked, format_dtype(job.region), names)
    measured = _check_pass(engine, goal, policy, cheap)
    notes = [f"{s.name} did not run in forward; not measured" for s in subjects if s not in ran]
    chosen = (policy, proposal, rows)
    return _advice(engine, goal, found, chosen, (region_sqnr, measured, cheap), notes)


def _advice(
    engine: Engine,
    goal: Goal,
    found: Found,
    chosen: tuple[Policy, Proposal, list[ModuleAdvice]],
    figures: tuple[float, float | None, Cheapest | None],
    notes: list[str],
) -> Advice:
    job = engine.job
    policy, proposal, rows = chosen
    region_sqnr, measured, cheap = figures
    once = cheap is None and measured is not None
    return Advice(
        policy=policy,
        dtype=job.region,
        device_type=job.device.type,
        init_scale=engine.scale if uses_fp16(job) else None,
        kept_precision=high_word(job.candidates, job.region),
        modules=tuple(rows),
        candidates=tuple(c.word for c in job.candidates),
        min_sqnr=goal.target.min_sqnr,
        keep_at_most=goal.target.keep_at_most,
        met=proposal.met,
        predicted_sqnr=measured if once and measured is not None else proposal.predicted,
        region_sqnr=region_sqnr,
        measured_sqnr=measured,
        cheapest=cheap,
        passes=engine.passes,
        notes=tuple(notes + _unserved_note(rows) + proposal.notes),
        gpu=None if goal.gpu is None else goal.gpu.word,
        objective=goal.target.objective,
        step=_step(goal.gpu, found, rows),
        per_matmul=goal.per_matmul,
        min_speedup=goal.min_speedup,
    )


def _once(goal: Goal) -> bool:
    """``objective="speed"`` without a target: the fastest options need no figure but being
    finite, which one pass of their policy shows; the modules alone are measured only if not."""
    target = goal.target
    return target.objective == "speed" and target.min_sqnr is None and target.keep_at_most is None


def _fastest_once(
    engine: Engine, ran: list[Subject], goal: Goal, flops: FlopCount | None
) -> Advice | None:
    """The fastest policy predicted from the reference pass's shapes, measured once; None when
    it gives inf/NaN (the caller then measures every module alone)."""
    job, gpu = engine.job, goal.gpu
    if uses_fp16(job):
        engine.scale = propose_scale([], engine.reference)
    served = [s for s in ran if s.serving]
    unmeasured = {s.name: [_unmeasured(c, goal.per_matmul) for c in s.serving] for s in served}
    found = _timed(Found(dict.fromkeys(unmeasured), unmeasured, {}, flops=flops), ran, job, gpu)
    touched = [s for s in served if found.gemms[s.name] is not None]
    proposal = _choose(engine, touched, found, 0.0, goal)
    names = [s.name for s in touched]
    picked = {c.name: c.current.word for c in proposal.choices}
    policy = build_policy(job.model, picked, format_dtype(job.region), names)
    sqnr = with_policy(engine, "the fastest policy, measured once", policy)
    if math.isnan(sqnr) or sqnr == -math.inf:
        engine.expect(_alone_passes(served, goal) + 2 + int(goal.check))
        engine.run_reference(ran)  # the modules' own tensors, to measure each alone
        return None
    rows = [_row(job, s, found, proposal, goal) for s in ran]
    note = (
        'objective="speed" without a target: the fastest policy on the GPU, predicted from '
        "the reference pass's GEMM shapes and measured once; the modules alone were not "
        "measured (pass min_sqnr or keep_at_most to measure each module in each candidate)"
    )
    return _advice(engine, goal, found, (policy, proposal, rows), (math.nan, sqnr, None), [note])


def _unmeasured(cand: Candidate, split: bool) -> Measurement:
    nan = math.nan
    matmuls = (nan, nan, nan) if split and cand.splits else None
    return Measurement(cand.word, nan, nan, None, None, matmuls=matmuls)


def _exact(found: list[Measurement]) -> bool:
    """Every candidate left the module exact (a norm whose ops autocast runs in float32)."""
    return all(m.model_grad_sqnr == math.inf for m in found)


def _timed(found: Found, subjects: list[Subject], job: Job, gpu: GPU | None) -> Found:
    """The modules' GEMMs and, with a GPU, each measurement's predicted time: the shapes of one
    pass predict every candidate."""
    for s in subjects:
        found.gemms[s.name] = gemm_shapes(s.module, s.record.outputs, s.record.input_grad_calls)
    if gpu is None:
        return found
    high = operands(None, job.region, high_word(job.candidates, job.region))
    found.kept_time = {s.name: predict(gpu, found.gemms[s.name], high) for s in subjects}
    for name, measured in found.alone.items():
        cands = [Candidate.of(m.candidate) for m in measured]
        found.alone[name] = [
            replace(m, time=predict(gpu, found.gemms[name], operands(c, job.region)))
            for m, c in zip(measured, cands, strict=True)
        ]
    return found


def _first_policies(job: Job, found: Found, names: list[str]) -> tuple[Policy, Policy]:
    """The region with every measured module in float32, and every module in its cheapest
    finite candidate (kept where none is finite): how far the additive model is off."""
    high = high_word(job.candidates, job.region)
    words = {}
    for name in names:
        first = _cheapest(found.alone[name])
        words[name] = high if first is None else first.candidate
    region_word = format_dtype(job.region)
    islands = build_policy(job.model, dict.fromkeys(names, "fp32"), region_word, names)
    return islands, build_policy(job.model, words, region_word, names)


def _cheapest(measured: list[Measurement]) -> Measurement | None:
    """The module's cheapest finite candidate in the cost order (with a GPU, its fastest)."""
    finite = [m for m in measured if m.finite]
    if not finite:
        return None
    return min(finite, key=lambda m: cost_key(m.candidate, 0.0 if m.time is None else m.time.total))


def _region_and_cheapest(engine: Engine, found: Found, names: list[str]) -> tuple[float, Cheapest]:
    """The region's own SQNR (every measured module in float32), and the cheapest policy,
    predicted and measured."""
    islands, cheapest = _first_policies(engine.job, found, names)
    region_sqnr = with_policy(engine, "region, measured modules in fp32", islands)
    measured = with_policy(engine, "every module in its cheapest candidate", cheapest)
    return region_sqnr, Cheapest(cheapest, _cheapest_db(found, region_sqnr, names), measured)


def _cheapest_db(found: Found, region_sqnr: float, names: list[str]) -> float:
    noise = db_to_ratio(region_sqnr)
    for name in names:
        first = _cheapest(found.alone[name])
        noise += 0.0 if first is None else db_to_ratio(first.model_grad_sqnr)
    return ratio_to_db(noise)


def _choose(
    engine: Engine, subjects: list[Subject], found: Found, region_sqnr: float, goal: Goal
) -> Proposal:
    """The search; when kept modules run in the region's 16-bit dtype (around fp8), each kept
    module is measured in it too and the search is redone with those figures (not for the
    fastest policy without a target, which needs no figure)."""
    job = engine.job
    high = high_word(job.candidates, job.region)
    kept_cand = None if high == "fp32" or _once(goal) else Candidate(high, job.region)
    while True:
        choices = [
            module_choice(
                s.name,
                found.alone[s.name],
                (high, found.kept.get(s.name), found.kept_time.get(s.name)),
                goal.gpu,
                fp16=found.ranges[s.name],
                per_matmul=_per_matmul(job, found, s, goal),
            )
            for s in subjects
        ]
        target = replace(goal.target, max_time=_budget(goal, found, subjects))
        proposal = search(choices, db_to_ratio(region_sqnr), target)
        pairs = zip(subjects, proposal.choices, strict=True)
        missing = [s for s, c in pairs if c.kept and s.name not in found.kept]
        if kept_cand is None or not missing:
            return proposal
        engine.expect(len(missing))
        found.kept.update({s.name: isolated(engine, s, kept_cand) for s in missing})


def _per_matmul(job: Job, found: Found, s: Subject, goal: Goal) -> PerMatmul | None:
    if not goal.per_matmul:
        return None
    return PerMatmul(format_dtype(job.region), job.region, found.gemms.get(s.name), job.device)


def _check_pass(engine: Engine, goal: Goal, policy: Policy, cheapest: Cheapest) -> float | None:
    """With ``check``, the proposal's measured SQNR (the cheapest policy's pass if it is that)."""
    if not goal.check:
        return None
    if policy == cheapest.policy:
        engine.expect(-1)
        return cheapest.measured
    return with_policy(engine, "check: proposal applied", policy)


def _row(job: Job, s: Subject, found: Found, proposal: Proposal, goal: Goal) -> ModuleAdvice:
    choice = next((c for c in proposal.choices if c.name == s.name), None)
    measured = found.alone.get(s.name, ())
    chosen = None
    per = _per_matmul(job, found, s, goal)
    if per is not None and choice is not None and "/" in choice.current.word:
        chosen = mix_measurement(measured, choice.current, per, goal.gpu)
    return ModuleAdvice(
        name=s.name,
        kind=type(s.module).__name__,
        params=sum(p.numel() for p in s.module.parameters()),
        calls=s.record.calls,
        measurements=tuple(found.alone.get(s.name, ())),
        fp16=found.ranges.get(s.name),
        choice=format_dtype(job.region) if choice is None else choice.current.word,
        reason=_no_rule_reason(s) if choice is None else choice.reason,
        kept_measurement=found.kept.get(s.name),
        served=choice is not None,
        kept_time=found.kept_time.get(s.name),
        chosen=chosen,
        gemms=found.gemms.get(s.name),
    )


def _no_rule_reason(s: Subject) -> str:
    if s.serving:  # measured, exact in every candidate
        return (
            "no error in any candidate (no matmul: autocast runs its ops in float32): no rule, "
            "runs as the region runs it"
        )
    kind = type(s.module).__name__
    return f"no candidate serves {kind} ({s.why_not}): no rule, runs as the region runs it"


def _unserved_note(rows: list[ModuleAdvice]) -> list[str]:
    unserved = [r for r in rows if not r.served]
    if not unserved:
        return []
    kinds: dict[str, int] = {}
    for r in unserved:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    listed = ", ".join(f"{n} x{k}" if k > 1 else n for n, k in kinds.items())
    return [
        f"{len(unserved)} measured modules get no rule ({listed}; the table says why): they "
        "run as the region runs them and are not counted as kept"
    ]


def _step(gpu: GPU | None, found: Found, rows: list[ModuleAdvice]) -> StepTime | None:
    """The step's matmuls: the baseline has every measured module in 16-bit."""
    if gpu is None or found.flops is None:
        return None
    bf16 = Operands.uniform(BF16)
    timed = []
    for r in rows:
        base = predict(gpu, found.gemms[r.name], bf16)
        timed.append((r.name, base, r.time if r.served else base))
    return step_time(gpu, timed, _other_flops(found))


def _other_flops(found: Found) -> float:
    """The step's matmul FLOP outside the measured modules' GEMMs."""
    assert found.flops is not None
    mine = sum(counted_flops(g) for g in found.gemms.values())
    return max(0.0, found.flops.total - mine)


def _budget(goal: Goal, found: Found, searched: list[Subject]) -> float | None:
    """For ``min_speedup``: the seconds the searched modules may take together."""
    gpu, speedup = goal.gpu, goal.min_speedup
    if gpu is None or speedup is None or found.flops is None:
        return None
    bf16 = Operands.uniform(BF16)
    base = {n: predict(gpu, g, bf16) for n, g in found.gemms.items()}
    times = {n: t.total for n, t in base.items() if t is not None}
    mine = sum(times.get(s.name, 0.0) for s in searched)
    baseline = sum(times.values()) + step_time(gpu, [], _other_flops(found)).other
    return time_budget(baseline, mine, speedup)
