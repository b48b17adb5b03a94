"""A module's options for the search, from its measurements: the same for advise and Watch.

An option is a candidate the module was measured in and, with a GPU, that the GPU runs in
hardware (a recipe without a kernel there is measured and shown, never chosen), then keeping the
module: its figures are its measurement in the kept precision when there is one (around fp8,
the region's 16-bit dtype), else no error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from mixprec._src.advisor.arguments import Candidate
from mixprec._src.advisor.choose.search import Choice, Option
from mixprec._src.advisor.measure.metrics import db_to_ratio
from mixprec._src.advisor.report.advice import Fp16Range, Measurement
from mixprec._src.advisor.speed.gpus import GPU
from mixprec._src.advisor.speed.model import Time
from mixprec._src.advisor.speed.operands import no_kernel, runs_on


def module_choice(
    name: str,
    found: Sequence[Measurement],
    kept: tuple[str, Measurement | None, Time | None],
    gpu: GPU | None,
    db_of: Callable[[Measurement], float] | None = None,
    fp16: Fp16Range | None = None,
) -> Choice:
    """The module's :class:`Choice`: ``kept`` is (kept word, its measurement or None, its
    time); ``db_of`` gives a measurement's whole-model gradient SQNR (default: as measured;
    Watch lowers it by the margin lost since)."""
    db_of = db_of or _measured_db
    runnable = [m for m in found if gpu is None or runs_on(gpu, Candidate.of(m.candidate))]
    options = [_option(m.candidate, db_of(m), m.time) for m in runnable]
    word, kept_m, kept_time = kept
    options.append(_option(word, math.inf if kept_m is None else db_of(kept_m), kept_time))
    no_option = None
    if found and not runnable:
        assert gpu is not None
        no_option = no_kernel(gpu, [Candidate.of(m.candidate) for m in found])
    return Choice(name, options, detail=overflow_detail(fp16), no_option=no_option)


def _measured_db(m: Measurement) -> float:
    return m.model_grad_sqnr if m.finite else -math.inf


def _option(word: str, db: float, time: Time | None) -> Option:
    ratio = math.inf if db == -math.inf else db_to_ratio(db)
    return Option(word, ratio, db, 0.0 if time is None else time.total)


def overflow_detail(fp16: Fp16Range | None) -> str | None:
    """Why float16 fails on a module, when its range figures say so."""
    if fp16 is None:
        return None
    if fp16.output_overflow:
        return (
            f"{fp16.output_overflow} outputs above the fp16 max 65504, "
            f"largest {fp16.output_max:.3g}"
        )
    if fp16.grad_overflow_scaled:
        return f"{fp16.grad_overflow_scaled} gradients overflow fp16 at the proposed scale"
    return None
