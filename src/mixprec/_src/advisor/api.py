"""``mixprec.advise``: measure every module in every candidate precision, propose the policy."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec._src.advisor import measure
from mixprec._src.advisor.candidates import Candidate, high_word, parse_candidates, region_dtype
from mixprec._src.advisor.engine import Engine, Job, Progress, Target, propose_scale
from mixprec._src.advisor.metrics import db_to_ratio
from mixprec._src.advisor.propose import Choice, Option, Proposal, build_policy, search
from mixprec._src.advisor.report import Advice, Fp16Range, Measurement, ModuleAdvice
from mixprec._src.advisor.select import select
from mixprec._src.advisor.state import Guard
from mixprec._src.autocast.rules import format_dtype
from mixprec._src.fp8 import hook as fp8_hook
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
) -> Advice:
    """Measure each module's error in each candidate precision and propose a :class:`Policy`.

    Runs a float32 reference forward+backward (``loss_fn(model, batch).backward()``), then one
    pass per module and candidate with only that module in the candidate precision, and one
    pass of the region with every measured module in float32 (the error of the ops between
    them); around fp8, each kept module is also measured in the region's dtype. Per module it
    reports the SQNR of the output, of the input and weight gradients and of the whole model's
    gradient, for float16 the values out of range and the gradients that flush to zero with and
    without loss scaling, for fp8 the saturated and flushed fractions of each operand. The
    proposal keeps the most sensitive modules out of the candidates until the predicted
    whole-model gradient SQNR meets ``min_sqnr`` (or keeps the ``keep_at_most`` most sensitive
    ones). The model's parameters, buffers, ``.grad`` and torch's RNG state are left as they
    were.

    Args:
        model: the model, on the device to measure on.
        batch: one batch, passed to ``loss_fn`` as is.
        loss_fn: ``loss_fn(model, batch)`` returns the scalar loss (it calls the model).
        candidates: rule words, cheapest first: ``"fp16"``, ``"bf16"``, fp8 recipes
            (``"fp8"``, ``"fp8:rowwise"``, ``"fp8:rowwise_gw_hp"``; they serve ``nn.Linear``)
            (default: torch's autocast dtype for the device, e.g. bf16 on the CPU, fp16 on CUDA).
        min_sqnr: the target: the least whole-model gradient SQNR in dB.
        keep_at_most: the most modules to keep out of every candidate. Without ``min_sqnr``,
            the ``keep_at_most`` most sensitive modules are kept. With neither, only modules
            whose every candidate gives inf/NaN are kept.
        modules: what to measure: qualified-name globs or ``nn.Module`` classes (default: every
            leaf module with trainable parameters except norms and embeddings).
        more_batches: further batches; every pass runs over all of them.
        check: apply the proposal and measure its real SQNR (one more pass).
        progress: called as ``progress(done, total, label)`` after every pass.

    Returns:
        An :class:`~mixprec.types.Advice`: the policy, the region dtype, a suggested
        ``GradScaler`` ``init_scale``, the prediction and the per-module figures, with
        ``table()``, ``plot()`` and ``to_json()``.

    Raises:
        ConfigError: a bad argument, a loss function that does not return a scalar loss that
            requires grad, a float32 reference with inf/NaN gradients.

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
    _check_args(model, loss_fn, min_sqnr, keep_at_most, check)
    device = _device_of(model)
    cands = parse_candidates(candidates, device.type)
    region = region_dtype(cands)
    chosen = select(model, modules)
    job = Job(model, [batch, *more_batches], loss_fn, device, cands, region, progress)
    job.total_passes = _count_passes(cands, chosen, check)
    _check_served(cands, chosen)
    with Guard(model, device) as guard:
        engine = Engine(job, guard)
        targets = _targets(chosen, guard.params)
        return _advise(engine, targets, min_sqnr, keep_at_most, check)


def _advise(
    engine: Engine,
    targets: list[Target],
    min_sqnr: float | None,
    keep_at_most: int | None,
    check: bool,
) -> Advice:
    job = engine.job
    targets, notes = _reference(engine, targets)
    ranges = _fp16_ranges(engine, targets)
    found = {
        t.name: [measure.isolated(engine, t, c) for c in job.candidates if c.serves(t.module)]
        for t in targets
    }
    region_word, names = format_dtype(job.region), [t.name for t in targets]
    islands = build_policy(job.model, dict.fromkeys(names, "fp32"), region_word, names)
    region_sqnr = measure.with_policy(engine, "region, measured modules in fp32", islands)
    proposal, kept = _search(engine, targets, found, ranges, region_sqnr, (min_sqnr, keep_at_most))
    picked = {c.name: c.current.word for c in proposal.choices}
    policy = build_policy(job.model, picked, region_word, names)
    measured = measure.with_policy(engine, "check: proposal applied", policy) if check else None
    return Advice(
        policy=policy,
        dtype=job.region,
        device_type=job.device.type,
        init_scale=engine.scale if _uses_fp16(job) else None,
        kept_precision=high_word(job.candidates, job.region),
        modules=tuple(_module_advice(t, found, ranges, proposal, kept) for t in targets),
        candidates=tuple(c.word for c in job.candidates),
        min_sqnr=min_sqnr,
        keep_at_most=keep_at_most,
        met=proposal.met,
        predicted_sqnr=proposal.predicted,
        region_sqnr=region_sqnr,
        measured_sqnr=measured,
        mode="exact",
        passes=engine.passes,
        notes=tuple(notes + proposal.notes),
    )


def _reference(engine: Engine, targets: list[Target]) -> tuple[list[Target], list[str]]:
    """The float32 pass; the targets that ran, in the order they first ran, and notes."""
    engine.run_reference(targets)
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


def _search(
    engine: Engine,
    targets: list[Target],
    found: dict[str, list[Measurement]],
    ranges: dict[str, Fp16Range | None],
    region_sqnr: float,
    target: tuple[float | None, int | None],
) -> tuple[Proposal, dict[str, Measurement]]:
    """The search; when kept modules run in the region's 16-bit dtype (around fp8), each kept
    module is measured in it too and the search is redone with those figures."""
    job = engine.job
    high = high_word(job.candidates, job.region)
    kept_cand = None if high == "fp32" else Candidate(high, job.region)
    kept: dict[str, Measurement] = {}
    while True:
        choices = [_choice(t.name, found[t.name], ranges[t.name], high, kept) for t in targets]
        proposal = search(choices, db_to_ratio(region_sqnr), *target)
        missing = [
            t
            for t, c in zip(targets, proposal.choices, strict=True)
            if c.kept and t.name not in kept
        ]
        if kept_cand is None or not missing:
            return proposal, kept
        job.total_passes += len(missing)
        kept.update({t.name: measure.isolated(engine, t, kept_cand) for t in missing})


def _option(m: Measurement) -> Option:
    return Option(
        m.candidate, db_to_ratio(m.model_grad_sqnr) if m.finite else math.inf, m.model_grad_sqnr
    )


def _choice(
    name: str,
    found: list[Measurement],
    fp16: Fp16Range | None,
    high: str,
    kept: dict[str, Measurement],
) -> Choice:
    last = _option(kept[name]) if name in kept else Option(high, 0.0, math.inf)
    options = [_option(m) for m in found] + [last]
    return Choice(name, options, detail=measure.overflow_detail(fp16))


def _module_advice(
    t: Target,
    found: dict[str, list[Measurement]],
    ranges: dict[str, Fp16Range | None],
    proposal: Proposal,
    kept: dict[str, Measurement],
) -> ModuleAdvice:
    choice = next(c for c in proposal.choices if c.name == t.name)
    return ModuleAdvice(
        name=t.name,
        kind=type(t.module).__name__,
        params=sum(p.numel() for p in t.module.parameters()),
        calls=t.record.calls,
        measurements=tuple(found[t.name]),
        fp16=ranges[t.name],
        choice=choice.current.word,
        reason=choice.reason,
        kept_measurement=kept.get(t.name),
    )


def _targets(chosen: list[tuple[str, nn.Module]], params: list[nn.Parameter]) -> list[Target]:
    position = {id(p): i for i, p in enumerate(params)}
    return [
        Target(name, mod, sorted({position[id(p)] for p in mod.parameters()}))
        for name, mod in chosen
    ]


def _count_passes(cands: list[Candidate], chosen: list[tuple[str, nn.Module]], check: bool) -> int:
    isolated = sum(c.serves(m) for c in cands for _, m in chosen)
    return 1 + isolated + 1 + int(check)  # kept modules measured in bf16 around fp8 add more


def _check_served(cands: list[Candidate], chosen: list[tuple[str, nn.Module]]) -> None:
    for cand in cands:
        if not any(cand.serves(m) for _, m in chosen):
            names = ", ".join(f"{n} ({type(m).__name__})" for n, m in chosen[:8])
            raise ConfigError(
                f"candidate {cand.word!r} serves {fp8_hook.SERVES}; none of the measured "
                f"modules is one: {names}{', ...' if len(chosen) > 8 else ''}"
            )


def _device_of(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _check_args(
    model: object, loss_fn: object, min_sqnr: object, keep_at_most: object, check: object
) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise ConfigError(
            f"loss_fn must be callable as loss_fn(model, batch) -> loss, got "
            f"{type(loss_fn).__name__}"
        )
    if min_sqnr is not None and (
        isinstance(min_sqnr, bool)
        or not isinstance(min_sqnr, (int, float))
        or not math.isfinite(min_sqnr)
    ):
        raise ConfigError(f"min_sqnr must be a finite number of dB or None, got {min_sqnr!r}")
    if keep_at_most is not None and (
        isinstance(keep_at_most, bool) or not isinstance(keep_at_most, int) or keep_at_most < 0
    ):
        raise ConfigError(f"keep_at_most must be an int >= 0 or None, got {keep_at_most!r}")
    if not isinstance(check, bool):
        raise ConfigError(f"check must be True or False, got {check!r}")
