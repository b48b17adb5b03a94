"""A module's options for the search, from its measurements: the same for advise and Watch.

An option is a candidate the module was measured in and, with a GPU, that the GPU runs in
hardware (a recipe without a kernel there is measured and shown, never chosen), then keeping the
module: its figures are its measurement in the kept precision when there is one (around fp8,
the region's 16-bit dtype), else no error.

Per matmul (:class:`PerMatmul`), the recipes measured one matmul at a time also combine: each
of the module's three matmuls takes one of those recipes or the region's dtype
(``"nvfp4/nvfp4/bf16"``). Such an option's error is its matmuls' errors added (a matmul in the
region's dtype adds none; the region's rounding of the module's input and output is counted in
the fprop figure, so a mix whose fprop is in the region's dtype leaves it out: a few hundredths
to tenths of a dB), its time the speed model's for that mix. Options come cheapest first in the
cost order of :mod:`.cost` (with a GPU the predicted time, else the bits per element), never in
the order the candidates were listed; options of equal cost (``fp8/fp8/bf16`` and
``bf16/fp8/fp8``) the most precise first.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mixprec._src.advisor.arguments import Candidate
from mixprec._src.advisor.choose.cost import cost_key
from mixprec._src.advisor.choose.search import Choice, Option
from mixprec._src.advisor.measure.metrics import db_to_ratio, ratio_to_db
from mixprec._src.advisor.report.advice import Fp16Range, Measurement
from mixprec._src.advisor.speed.gpus import GPU
from mixprec._src.advisor.speed.model import Gemms, Time, predict
from mixprec._src.advisor.speed.operands import no_kernel, operands, runs_on
from mixprec._src.autocast.rules import Rule
from mixprec._src.fp8.matmul import use_scaled_mm
from mixprec._src.fp8.recipes import get_recipe
from mixprec.errors import ConfigError

#: Adjusts an option's SQNR (dB) by its word (Watch lowers the chosen one by the margin lost).
Adjust = Callable[[str, float], float]


@dataclass(frozen=True)
class PerMatmul:
    """How to combine recipes per matmul: the word of a matmul in the region's dtype, the
    region's dtype, the module's GEMMs (for the mixes' times) and the device measured on (a
    mix it would refuse, half in hardware and half emulated, is no option)."""

    high: str
    region: torch.dtype
    gemms: Gemms | None
    device: torch.device


def module_choice(
    name: str,
    found: Sequence[Measurement],
    kept: tuple[str, Measurement | None, Time | None],
    gpu: GPU | None,
    adjust: Adjust | None = None,
    fp16: Fp16Range | None = None,
    per_matmul: PerMatmul | None = None,
) -> Choice:
    """The module's :class:`Choice`: ``kept`` is (kept word, its measurement or None, its
    time); ``adjust`` changes an option's SQNR (default: as measured); with ``per_matmul``,
    the mixes of the recipes measured per matmul are options too."""
    runnable = [m for m in found if gpu is None or runs_on(gpu, Candidate.of(m.candidate))]
    options = [_option(m.candidate, _db(m), m.time) for m in runnable]
    if per_matmul is not None:
        options += _mixes(found, gpu, per_matmul)
    options.sort(key=_order)
    word, kept_m, kept_time = kept
    options.append(_option(word, math.inf if kept_m is None else _db(kept_m), kept_time))
    if adjust is not None:
        options = [_adjusted(o, adjust) for o in options]
    no_option = None
    if found and not runnable:
        assert gpu is not None
        no_option = no_kernel(gpu, [Candidate.of(m.candidate) for m in found])
    return Choice(name, options, detail=overflow_detail(fp16), no_option=no_option)


def _order(o: Option) -> tuple[float, float, float, int, str]:
    """Cheapest first; among options of equal cost, the most precise first (a search that
    moves to the next more precise option then never takes a worse one of the same cost)."""
    time, bits, tie, word = cost_key(o.word, o.time)
    return time, bits, o.ratio, tie, word


def _db(m: Measurement) -> float:
    return m.model_grad_sqnr if m.finite else -math.inf


def _option(word: str, db: float, time: Time | None) -> Option:
    ratio = math.inf if db == -math.inf else db_to_ratio(db)
    return Option(word, ratio, db, 0.0 if time is None else time.total)


def _adjusted(o: Option, adjust: Adjust) -> Option:
    db = adjust(o.word, o.db)
    if db == o.db:
        return o
    return Option(o.word, math.inf if db == -math.inf else db_to_ratio(db), db, o.time)


def _mixes(found: Sequence[Measurement], gpu: GPU | None, per: PerMatmul) -> list[Option]:
    """Every mix of the recipes measured per matmul and the region's dtype, with at least two
    formats (a recipe on all three matmuls is that candidate already)."""
    parts: list[tuple[str, Sequence[float]]] = [
        (m.candidate, m.matmuls) for m in found if m.matmuls is not None
    ]
    if not parts:
        return []
    parts.append((per.high, (math.inf,) * 3))
    # A module whose input needs no gradient runs no dgrad: its format follows fprop's.
    dgrad = any(m.input_grad_sqnr is not None for m in found if m.matmuls is not None)
    out = []
    for combo in itertools.product(range(len(parts)), repeat=3):
        if len(set(combo)) == 1 or (not dgrad and combo[1] != combo[0]):
            continue
        words = [parts[j][0] for j in combo]
        rule = Rule("/".join(words))
        word = str(rule)
        if not _runs_here(rule, per.device):
            continue
        dbs = [parts[j][1][i] for i, j in enumerate(combo)]
        db = -math.inf if -math.inf in dbs else ratio_to_db(sum(db_to_ratio(d) for d in dbs))
        time = None
        if gpu is not None:
            cand = Candidate.of(word)
            if not runs_on(gpu, cand):
                continue
            time = predict(gpu, per.gemms, operands(cand, per.region))
        out.append(_option(word, db, time))
    return out


def _runs_here(rule: Rule, device: torch.device) -> bool:
    """Whether the device measured on takes ``rule``'s mix (a GPU refuses one whose recipes it
    runs some in hardware and not the others)."""
    try:
        use_scaled_mm(device, get_recipe(rule.recipe or ""))
    except ConfigError:
        return False
    return True


def mix_measurement(
    found: Sequence[Measurement], option: Option, per: PerMatmul, gpu: GPU | None
) -> Measurement:
    """The figures of a chosen mix (an option :func:`_mixes` built), as the prediction adds them
    up from the matmuls measured alone; the tensor figures were not measured (NaN)."""
    rule = Rule(option.word)
    assert rule.matmuls is not None
    by_word = {m.candidate: m.matmuls for m in found if m.matmuls is not None}
    dbs = [math.inf if w == per.high else by_word[w][i] for i, w in enumerate(rule.matmuls)]
    time = None
    if gpu is not None:
        time = predict(gpu, per.gemms, operands(Candidate.of(option.word), per.region))
    nan = math.nan
    matmuls = (dbs[0], dbs[1], dbs[2])
    return Measurement(option.word, option.db, nan, nan, nan, time=time, matmuls=matmuls)


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
