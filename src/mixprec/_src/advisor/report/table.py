"""The advisor's report as a text table: a group header over each candidate's columns, the
rows, a legend, the proposal, the prediction and (with a GPU) the predicted speed."""

from __future__ import annotations

import math
import textwrap
from typing import TYPE_CHECKING

from mixprec._src.autocast.rules import Rule, format_dtype
from mixprec._src.fp8.recipes import get_recipe

if TYPE_CHECKING:
    from mixprec._src.advisor.report.advice import Advice, ModuleAdvice
    from mixprec._src.advisor.speed.model import StepTime, Time

_OPERANDS = (("in", "input"), ("w", "weight"), ("go", "grad_output"))
_BY = {"speed": "speed", "fewest_kept": "fewest kept", "sqnr": "SQNR within the speedup"}


def fmt_db(value: float | None) -> str:
    """An SQNR for a table cell: one decimal, ``inf``, ``-inf`` (inf/NaN) or ``-`` (none, or
    not measured)."""
    if value is None or math.isnan(value):
        return "-"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.1f}"


def fmt_us(time: Time | None) -> str:
    """A predicted time in µs for a table cell (``-``: none)."""
    return "-" if time is None else f"{time.total * 1e6:.3g}"


def _option_us(m: ModuleAdvice, time: Time | None) -> str:
    """A candidate's µs: blank for a module without a GEMM, ``-`` where the GPU has no kernel
    for the recipe."""
    if time is not None:
        return fmt_us(time)
    return "" if m.kept_time is None else "-"


def _pct(value: float) -> str:
    return "0" if value == 0 else f"{100 * value:.2g}%"


def _timed(advice: Advice) -> bool:
    return advice.gpu is not None


def _groups(advice: Advice) -> list[tuple[str, list[str]]]:
    """(group label, its column names), left to right."""
    groups: list[tuple[str, list[str]]] = [("", ["module", "type", "params"])]
    per = ["model", "out", "in-grad", "w-grad"] + (["µs"] if _timed(advice) else [])
    groups += [(word, list(per)) for word in advice.candidates]
    if _has_fp16(advice):
        groups.append(("fp16 range", [">max", "flush@1", "flush@scale"]))
    groups += [(f"{word} casts", ["sat", "flush"]) for word in _fp8_words(advice)]
    last = ["decision"] + (["µs"] if _timed(advice) else []) + ["why"]
    return [*groups, ("proposal", last)]


def _fp8_words(advice: Advice) -> list[str]:
    """The candidates with fp8 cast statistics (the recipe candidates)."""
    return [w for w in advice.candidates if any(_has_stats(m, w) for m in advice.modules)]


def _has_stats(m: ModuleAdvice, word: str) -> bool:
    x = m.measurement(word)
    return x is not None and x.fp8 is not None


def _fp8_cells(advice: Advice, m: ModuleAdvice) -> list[str]:
    """Per recipe candidate, the largest saturated and flushed fractions over the module's
    operands, with the operand (in, w, go: input, weight, grad_output)."""
    cells = []
    for word in _fp8_words(advice):
        x = m.measurement(word)
        if x is None or x.fp8 is None:
            cells += ["", ""]
            continue
        worst = {"saturated": (0.0, ""), "flushed": (0.0, "")}
        for short, operand in _OPERANDS:
            stats = getattr(x.fp8, operand)
            for key in worst:
                if getattr(stats, key) > worst[key][0]:
                    worst[key] = (getattr(stats, key), short)
        cells += [f"{_pct(v)} {op}".strip() for v, op in worst.values()]
    return cells


def _has_fp16(advice: Advice) -> bool:
    return any(m.fp16 is not None for m in advice.modules)


def _row(advice: Advice, m: ModuleAdvice) -> list[str]:
    cells = [m.name, m.kind, f"{m.params:,}"]
    width = 5 if _timed(advice) else 4
    for word in advice.candidates:
        x = m.measurement(word)
        if x is None:
            cells += ["n/a"] + [""] * (width - 1)
            continue
        cells += [
            fmt_db(x.model_grad_sqnr),
            fmt_db(x.output_sqnr),
            fmt_db(x.input_grad_sqnr),
            fmt_db(x.weight_grad_sqnr),
        ] + ([_option_us(m, x.time)] if _timed(advice) else [])
    if _has_fp16(advice):
        f = m.fp16
        cells += (
            ["", "", ""]
            if f is None
            else [str(f.output_overflow), _pct(f.flushed_unscaled), _pct(f.flushed_scaled)]
        )
    cells += _fp8_cells(advice, m)
    decision = m.choice if m.served else "-"
    return [*cells, decision, *([_option_us(m, m.time)] if _timed(advice) else []), m.reason]


def _align(groups: list[tuple[str, list[str]]], rows: list[list[str]]) -> list[str]:
    names = [c for _, cols in groups for c in cols]
    table = [names, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(names))]
    left = {i for i, n in enumerate(names) if n in ("module", "type", "decision", "why")}

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in pairs).rstrip()

    return [_group_line(groups, widths), *(line(r) for r in table)]


def _group_line(groups: list[tuple[str, list[str]]], widths: list[int]) -> str:
    parts, i = [], 0
    for label, cols in groups:
        span = sum(widths[i : i + len(cols)]) + 2 * (len(cols) - 1)
        i += len(cols)
        text = f" {label} " if label else ""
        parts.append(text.center(span, "-") if label else " " * span)
    return "  ".join(parts).rstrip()


def render(advice: Advice) -> str:
    """The whole report: a heading, the per-module table, its legend, the proposal, the
    prediction and the predicted speed."""
    groups = _groups(advice)
    rows = [_row(advice, m) for m in advice.modules]
    speed = f"; speed on {advice.step.gpu}" if advice.step is not None else ""
    lines = [
        f"mixprec advise: {len(advice.modules)} modules, candidates "
        f"{', '.join(advice.candidates)}, region {format_dtype(advice.dtype)}, "
        f"{advice.passes} passes{speed}",
        "SQNR (signal-to-quantization-noise ratio) against float32, in dB: higher is better "
        "(one tensor rounded to bf16: about 47; to fp8: 21-29)",
        "",
        *_align(groups, rows),
        "",
        *_legend(advice),
        *_per_matmul(advice),
        "",
        f"policy:      {_policy_text(advice)}",
        f"region:      mixprec.autocast({advice.device_type!r}, dtype=torch."
        f"{str(advice.dtype).removeprefix('torch.')}, policy=...)",
    ]
    if advice.init_scale is not None:
        lines.append(f"init_scale:  {advice.init_scale:g} (mixprec.GradScaler(init_scale=...))")
    lines.append(_prediction(advice))
    if advice.measured_sqnr is not None:
        lines.append(f"measured:    {fmt_db(advice.measured_sqnr)} dB with the policy applied")
    lines += _model_check(advice)
    lines += _speed(advice)
    lines += [f"note:        {n}" for n in advice.notes]
    return "\n".join(lines)


def _legend(advice: Advice) -> list[str]:
    return [w for line in _legend_lines(advice) for w in textwrap.wrap(line, 100)]


def _legend_lines(advice: Advice) -> list[str]:
    lines = [
        "model: the whole model's gradient SQNR with only this module in the candidate (what "
        "the prediction adds up); out, in-grad, w-grad: the module's output, input gradient "
        "and weight gradient"
    ]
    if _split_words(advice):
        lines.append(
            "a recipe measured per matmul: model is its three matmuls' errors added (the "
            "table per matmul below); out from the pass with fprop alone in the recipe, "
            "in-grad and w-grad from the pass with dgrad and wgrad in it"
        )
    if _timed(advice) and advice.step is not None:
        lines.append(
            f"µs: predicted time per step on {advice.step.gpu} (the module's three GEMMs "
            "and its casts; '-': the GPU has no kernel for that recipe: measured emulated, "
            "never chosen; blank: not timed alone, no Linear or conv GEMM)"
        )
    unserved = _unserved_words(advice)
    if unserved:
        blocks = ", ".join(
            f"{w}: {k}" if k == n else f"{w}: {k} in, {n} out" for w, (k, n) in unserved.items()
        )
        lines.append(
            "n/a: the candidate cannot serve that module (a recipe serves nn.Linear layers whose "
            f"in and out features are multiples of its blocks; {blocks})"
        )
    if _has_fp16(advice):
        lines.append(
            "fp16 range: outputs above 65504 (>max); non-zero gradients fp16 rounds to 0 "
            "without loss scaling (flush@1) and at init_scale (flush@scale)"
        )
    if _fp8_words(advice):
        lines.append(
            "<recipe> casts: with that candidate, the largest fraction of values at the "
            "format's maximum (sat) and of non-zero values flushed to 0 (flush), with the "
            "operand: in input, w weight, go output gradient"
        )
    return lines


def _split_words(advice: Advice) -> list[str]:
    """The candidates measured one matmul at a time."""
    return [
        w
        for w in advice.candidates
        if any((x := m.measurement(w)) is not None and x.matmuls for m in advice.modules)
    ]


def _per_matmul(advice: Advice) -> list[str]:
    """Which matmul carries each module's error, per recipe: the whole-model gradient SQNR
    with only that matmul in the recipe; ``*`` marks the module's worst in each."""
    words = _split_words(advice)
    if not words:
        return []
    groups: list[tuple[str, list[str]]] = [("", ["module"])]
    groups += [(w, ["fprop", "dgrad", "wgrad"]) for w in words]
    groups.append(("", ["decision"]))
    rows = []
    for m in advice.modules:
        cells = [m.name]
        for w in words:
            x = m.measurement(w)
            cells += _matmul_cells(None if x is None else x.matmuls)
        rows.append([*cells, m.choice if m.served else "-"])
    head = (
        "per matmul: the whole-model gradient SQNR with only that matmul of the module in the "
        "recipe (dB; * the module's worst: the matmul that carries its error)"
    )
    return ["", *textwrap.wrap(head, 100), *_align(groups, rows)]


def _matmul_cells(dbs: tuple[float, float, float] | None) -> list[str]:
    if dbs is None:
        return ["", "", ""]
    worst = min(range(3), key=lambda i: dbs[i])
    return [fmt_db(d) + ("*" if i == worst and math.isfinite(d) else "") for i, d in enumerate(dbs)]


def _unserved_words(advice: Advice) -> dict[str, tuple[int, int]]:
    """The recipe candidates with an ``n/a`` cell, with the feature multiples they need."""
    found = {}
    for word in advice.candidates:
        recipe = Rule(word).recipe
        if recipe is not None and any(m.measurement(word) is None for m in advice.modules):
            _, k, n = get_recipe(recipe).multiples()
            found[word] = (k, n)
    return found


def _policy_text(advice: Advice) -> str:
    text = str(advice.policy)
    return text or f"(no rules: the whole region in {format_dtype(advice.dtype)})"


def _prediction(advice: Advice) -> str:
    target = []
    if advice.min_sqnr is not None:
        target.append(f">= {fmt_db(advice.min_sqnr)} dB")
    if advice.keep_at_most is not None:
        target.append(f"at most {advice.keep_at_most} kept")
    if advice.min_speedup is not None:
        target.append(f"at least {advice.min_speedup:g}x faster than bf16")
    status = (
        f" (target {', '.join(target)}: {'met' if advice.met else 'NOT met'})" if target else ""
    )
    return (
        f"predicted:   {fmt_db(advice.predicted_sqnr)} dB whole-model gradient SQNR, "
        f"{len(advice.kept)} kept in {advice.kept_precision}{status}; {between(advice.region_sqnr)}"
    )


def between(region_sqnr: float) -> str:
    """What the ops between the measured modules cost, in words (an infinite SQNR: nothing).

    Example:
        >>> between(float("inf"))
        'the ops between the measured modules add no measurable error'
        >>> between(66.6)
        'the ops between the measured modules, every module in fp32: 66.6 dB'
    """
    if math.isinf(region_sqnr) and region_sqnr > 0:
        return "the ops between the measured modules add no measurable error"
    if math.isnan(region_sqnr):
        return "the ops between the measured modules: not measured"
    return f"the ops between the measured modules, every module in fp32: {fmt_db(region_sqnr)} dB"


def _model_check(advice: Advice) -> list[str]:
    c = advice.cheapest
    if c is None:
        return []
    line = (
        f"model check: every module in its cheapest candidate: predicted {fmt_db(c.predicted)} "
        f"dB, measured {fmt_db(c.measured)} dB"
    )
    if not math.isfinite(c.error):
        return [line]
    if abs(c.error) <= 1.0:
        return [f"{line}: the prediction holds here ({round(c.error, 1) + 0.0:+.1f} dB)"]
    side = "pessimistic" if c.error > 0 else "optimistic"
    return [
        f"{line}: the prediction is {side} by {abs(c.error):.1f} dB here (errors of different "
        "modules are not independent); trust check=True's measurement"
    ]


def _speed(advice: Advice) -> list[str]:
    step = advice.step
    if step is None:
        return []
    lines = [
        f"speed:       {_us(step.proposal)} of matmuls per step on {step.gpu}, "
        f"{_us(step.baseline)} in bf16: {step.speedup:.2f}x (chosen by "
        f"{_BY[advice.objective]})",
        f"time goes:   measured modules' GEMMs {_us(step.gemms)}, their casts "
        f"{_us(step.casts)}, other matmuls (attention) {_us(step.other)}",
        f"             (not modelled: {_left_out(step)}elementwise ops, norms, the "
        "optimizer, communication)",
    ]
    top = sorted((m for m in advice.modules if m.time is not None), key=_total, reverse=True)
    if top:
        lines.append(
            "slowest:     "
            + ", ".join(f"{m.name}: {fmt_us(m.time)} µs ({m.choice})" for m in top[:3])
        )
    return lines


def _left_out(step: StepTime) -> str:
    if not step.left_out:
        return ""
    names = ", ".join(step.left_out[:4]) + (", ..." if len(step.left_out) > 4 else "")
    return (
        f"{len(step.left_out)} measured modules not timed alone ({names}: no Linear or conv "
        "GEMM; any matmul of theirs is in other matmuls), "
    )


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} µs"


def _total(m: ModuleAdvice) -> float:
    return 0.0 if m.time is None else m.time.total
