"""The advisor's run, in order: the reference pass, the measurements, the search, the report."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from mixprec._src.advisor import measure
from mixprec._src.advisor.candidates import Candidate, high_word
from mixprec._src.advisor.engine import Engine, Job, Target, propose_scale
from mixprec._src.advisor.fastest import search_fastest
from mixprec._src.advisor.gpus import GPU
from mixprec._src.advisor.metrics import db_to_ratio, ratio_to_db
from mixprec._src.advisor.propose import Choice, Option, Proposal, build_policy, search
from mixprec._src.advisor.report import (
    Advice,
    Cheapest,
    Fp16Range,
    Measurement,
    ModuleAdvice,
    StepTime,
)
from mixprec._src.advisor.speed import BF16, Operands, Time
from mixprec._src.advisor.timing import (
    FlopCount,
    counted_flops,
    operands,
    option_time,
    step_time,
)
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.rules import format_dtype


@dataclass(frozen=True)
class Goal:
    """What the search aims for."""

    min_sqnr: float | None
    keep_at_most: int | None
    objective: str
    gpu: GPU | None
    check: bool


def run(engine: Engine, targets: list[Target], goal: Goal) -> Advice:
    """Measure, search and report (the model is guarded by the caller)."""
    job = engine.job
    flops = FlopCount() if goal.gpu is not None else None
    targets, notes = _reference(engine, targets, flops)
    served = [t for t in targets if any(c.serves(t.module) for c in job.candidates)]
    ranges = _fp16_ranges(engine, served)
    found = {t.name: [_measured(engine, t, c, goal.gpu) for c in _serving(job, t)] for t in served}
    region_word = format_dtype(job.region)
    names = [t.name for t in served]
    islands = build_policy(job.model, dict.fromkeys(names, "fp32"), region_word, names)
    region_sqnr = measure.with_policy(engine, "region, measured modules in fp32", islands)
    cheapest = _cheapest(engine, found, region_sqnr, names)
    proposal, kept = _search(engine, served, found, ranges, region_sqnr, goal)
    picked = {c.name: c.current.word for c in proposal.choices}
    policy = build_policy(job.model, picked, region_word, names)
    measured = _check_pass(engine, goal, policy, cheapest)
    rows = [_module_advice(engine, t, found, ranges, proposal, kept, goal.gpu) for t in targets]
    notes += _unserved_note([t for t in targets if t not in served])
    return Advice(
        policy=policy,
        dtype=job.region,
        device_type=job.device.type,
        init_scale=engine.scale if _uses_fp16(job) else None,
        kept_precision=high_word(job.candidates, job.region),
        modules=tuple(rows),
        candidates=tuple(c.word for c in job.candidates),
        min_sqnr=goal.min_sqnr,
        keep_at_most=goal.keep_at_most,
        met=proposal.met,
        predicted_sqnr=proposal.predicted,
        region_sqnr=region_sqnr,
        measured_sqnr=measured,
        cheapest=cheapest,
        mode="exact",
        passes=engine.passes,
        notes=tuple(notes + proposal.notes),
        gpu=None if goal.gpu is None else goal.gpu.word,
        objective=goal.objective,
        step=_step(goal.gpu, targets, rows, flops),
    )


def _check_pass(engine: Engine, goal: Goal, policy: Policy, cheapest: Cheapest) -> float | None:
    """With ``check``, the proposal's measured SQNR (the cheapest policy's pass if it is that)."""
    if not goal.check:
        return None
    if policy == cheapest.policy:
        engine.job.total_passes -= 1
        return cheapest.measured
    return measure.with_policy(engine, "check: proposal applied", policy)


def _cheapest(
    engine: Engine, found: dict[str, list[Measurement]], region_sqnr: float, names: list[str]
) -> Cheapest:
    """Every module in its cheapest finite candidate (kept where none is finite), predicted
    and measured: how far the additive model is off on this model."""
    job = engine.job
    high = high_word(job.candidates, job.region)
    words, noise = {}, db_to_ratio(region_sqnr)
    for name in names:
        first = next((m for m in found[name] if m.finite), None)
        words[name] = high if first is None else first.candidate
        noise += 0.0 if first is None else db_to_ratio(first.model_grad_sqnr)
    policy = build_policy(job.model, words, format_dtype(job.region), names)
    label = "every module in its cheapest candidate"
    return Cheapest(policy, ratio_to_db(noise), measure.with_policy(engine, label, policy))


def _serving(job: Job, t: Target) -> list[Candidate]:
    return [c for c in job.candidates if c.serves(t.module)]


def _unserved_note(unserved: list[Target]) -> list[str]:
    if not unserved:
        return []
    kinds: dict[str, int] = {}
    for t in unserved:
        kinds[type(t.module).__name__] = kinds.get(type(t.module).__name__, 0) + 1
    listed = ", ".join(f"{n} x{k}" if k > 1 else n for n, k in kinds.items())
    return [
        f"{len(unserved)} measured modules no candidate serves ({listed}): they get no rule, "
        "run as the region runs them and are not counted as kept"
    ]


def _reference(
    engine: Engine, targets: list[Target], flops: FlopCount | None
) -> tuple[list[Target], list[str]]:
    """The float32 pass; the targets that ran, in the order they first ran, and notes."""
    engine.run_reference(targets, flops)
    notes = [
        f"{t.name} did not run in forward; not measured" for t in targets if not t.record.calls
    ]
    ran = sorted((t for t in targets if t.record.calls), key=lambda t: t.record.first_call)
    return ran, notes


def _uses_fp16(job: Job) -> bool:
    return job.region == torch.float16 or any(c.is_fp16 for c in job.candidates)


def _fp16_ranges(engine: Engine, targets: list[Target]) -> dict[str, Fp16Range | None]:
    """With float16 in play: the proposed loss scale (every later pass uses it) and each
    target's range figures; else no figures and no scale."""
    if not _uses_fp16(engine.job):
        return dict.fromkeys((t.name for t in targets), None)
    engine.scale = propose_scale(targets, engine.reference)
    return {t.name: measure.fp16_range(t, engine.reference, engine.scale) for t in targets}


def _measured(engine: Engine, t: Target, cand: Candidate, gpu: GPU | None) -> Measurement:
    m = measure.isolated(engine, t, cand)
    if gpu is None:
        return m
    ops = operands(cand.word, cand, engine.job.region)
    return dataclasses.replace(m, time=option_time(gpu, t.module, t.record, ops))


def _kept_time(engine: Engine, t: Target, gpu: GPU | None) -> Time | None:
    if gpu is None:
        return None
    job = engine.job
    word = high_word(job.candidates, job.region)
    return option_time(gpu, t.module, t.record, operands(word, None, job.region))


def _search(
    engine: Engine,
    targets: list[Target],
    found: dict[str, list[Measurement]],
    ranges: dict[str, Fp16Range | None],
    region_sqnr: float,
    goal: Goal,
) -> tuple[Proposal, dict[str, Measurement]]:
    """The search; when kept modules run in the region's 16-bit dtype (around fp8), each kept
    module is measured in it too and the search is redone with those figures."""
    job = engine.job
    high = high_word(job.candidates, job.region)
    kept_cand = None if high == "fp32" else Candidate(high, job.region)
    kept: dict[str, Measurement] = {}
    times = {t.name: _kept_time(engine, t, goal.gpu) for t in targets}
    finder = search_fastest if goal.objective == "speed" else search
    while True:
        choices = [
            _choice(t.name, found[t.name], ranges[t.name], high, kept, times[t.name])
            for t in targets
        ]
        proposal = finder(choices, db_to_ratio(region_sqnr), goal.min_sqnr, goal.keep_at_most)
        missing = [
            t
            for t, c in zip(targets, proposal.choices, strict=True)
            if c.kept and t.name not in kept
        ]
        if kept_cand is None or not missing:
            return proposal, kept
        job.total_passes += len(missing)
        kept.update({t.name: measure.isolated(engine, t, kept_cand) for t in missing})


def _seconds(time: Time | None) -> float:
    return 0.0 if time is None else time.total


def _option(m: Measurement, has_time: bool) -> Option:
    ratio = db_to_ratio(m.model_grad_sqnr) if m.finite else math.inf
    seconds = _seconds(m.time) if m.time is not None or not has_time else math.inf
    return Option(m.candidate, ratio, m.model_grad_sqnr, seconds)


def _choice(
    name: str,
    found: list[Measurement],
    fp16: Fp16Range | None,
    high: str,
    kept: dict[str, Measurement],
    kept_time: Time | None,
) -> Choice:
    """A module's options; with a GEMM on the target, a candidate the target cannot run is an
    option of infinite time."""
    has_time = kept_time is not None
    if name in kept:
        last = dataclasses.replace(_option(kept[name], False), word=high, time=_seconds(kept_time))
    else:
        last = Option(high, 0.0, math.inf, _seconds(kept_time))
    options = [_option(m, has_time) for m in found] + [last]
    return Choice(name, options, detail=measure.overflow_detail(fp16))


def _module_advice(
    engine: Engine,
    t: Target,
    found: dict[str, list[Measurement]],
    ranges: dict[str, Fp16Range | None],
    proposal: Proposal,
    kept: dict[str, Measurement],
    gpu: GPU | None,
) -> ModuleAdvice:
    choice = next((c for c in proposal.choices if c.name == t.name), None)
    region_word = format_dtype(engine.job.region)
    return ModuleAdvice(
        name=t.name,
        kind=type(t.module).__name__,
        params=sum(p.numel() for p in t.module.parameters()),
        calls=t.record.calls,
        measurements=tuple(found.get(t.name, ())),
        fp16=ranges.get(t.name),
        choice=region_word if choice is None else choice.current.word,
        reason=_unserved_reason(t) if choice is None else choice.reason,
        kept_measurement=kept.get(t.name),
        served=choice is not None,
        kept_time=_kept_time(engine, t, gpu),
    )


def _unserved_reason(t: Target) -> str:
    return f"no candidate serves {type(t.module).__name__}: no rule, runs as the region runs it"


def _step(
    gpu: GPU | None, targets: list[Target], rows: list[ModuleAdvice], flops: FlopCount | None
) -> StepTime | None:
    """The step's matmuls: the baseline has every measured module in 16-bit."""
    if gpu is None or flops is None:
        return None
    region = [option_time(gpu, t.module, t.record, Operands.uniform(BF16)) for t in targets]
    chosen = [r.time if r.served else b for r, b in zip(rows, region, strict=True)]
    mine = sum(counted_flops(t.module, t.record) for t in targets)
    return step_time(gpu, region, chosen, max(0.0, flops.total - mine))
