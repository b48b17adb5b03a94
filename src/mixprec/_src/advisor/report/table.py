"""The advisor's report as a text table: a group header over each candidate's columns, the
rows, a legend, the proposal, the prediction and (with a GPU) the predicted speed."""

from __future__ import annotations

import math
import textwrap
from typing import TYPE_CHECKING

from mixprec._src.advisor.report.matmuls import summary as matmul_summary
from mixprec._src.autocast.rules import Rule, format_dtype
from mixprec._src.fp8.recipes import get_recipe
from mixprec._src.fp8.stats import wrap_name

if TYPE_CHECKING:
    from mixprec._src.advisor.report.advice import Advice, ModuleAdvice
    from mixprec._src.advisor.speed.model import StepTime, Time

_OPERANDS = (("in", "input"), ("w", "weight"), ("go", "grad_output"))
#: The wide table's SQNR columns per candidate: the names of ``Measurement``'s fields.
_TENSORS = ("model-grad", "output", "input-grad", "weight-grad")
#: The widest a table line is by default (``wide=False``); module names wrap to fit.
WIDTH = 100
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
    """The wide table's (group label, its column names), left to right."""
    groups: list[tuple[str, list[str]]] = [("", ["module", "type", "params"])]
    per = [*_TENSORS] + (["µs"] if _timed(advice) else [])
    groups += [(word, list(per)) for word in advice.candidates]
    if _has_fp16(advice):
        groups.append(("fp16 range", [">max", "flush@1", "flush@scale"]))
    groups += [(f"{word} casts", ["at-max", "flush"]) for word in _fp8_words(advice)]
    last = ["decision"] + (["µs"] if _timed(advice) else []) + ["why"]
    return [*groups, ("proposal", last)]


def _narrow_groups(advice: Advice) -> list[tuple[str, list[str]]]:
    """The default table's groups: per candidate its model-grad SQNR, the decision (and its
    µs)."""
    groups: list[tuple[str, list[str]]] = [("", ["module", "type"])]
    groups.append(("model-grad (dB)", list(advice.candidates)))
    return [*groups, ("proposal", ["decision"] + (["µs"] if _timed(advice) else []))]


def _narrow_row(advice: Advice, m: ModuleAdvice) -> list[str]:
    found = [m.measurement(w) for w in advice.candidates]
    cells = [m.name, m.kind] + ["n/a" if x is None else fmt_db(x.model_grad_sqnr) for x in found]
    decision = m.choice if m.served else "-"
    return [*cells, decision, *([_option_us(m, m.time)] if _timed(advice) else [])]


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


def _align(
    groups: list[tuple[str, list[str]]], rows: list[list[str]], width: int | None = None
) -> list[str]:
    """The header lines and rows, columns aligned; with ``width``, module names (the first
    column) wrap at their dots so that lines fit it where they can."""
    names = [c for _, cols in groups for c in cols]
    table = [names, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(names))]
    end = 0
    for label, cols in groups:  # a group's label fits over its columns
        end += len(cols)
        span = sum(widths[end - len(cols) : end]) + 2 * (len(cols) - 1)
        widths[end - 1] += max(0, len(label) + 4 - span) if label else 0
    if width is not None:
        rest = sum(widths[1:]) + 2 * (len(widths) - 1)
        widths[0] = min(widths[0], max(_MIN_NAME, width - rest))
        table = [names, *(line for r in rows for line in _wrapped(r, widths[0]))]
    left = {i for i, n in enumerate(names) if n in ("module", "type", "decision", "why")}

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in pairs).rstrip()

    return [_group_line(groups, widths), *(line(r) for r in table)]


_MIN_NAME = 16


def _wrapped(row: list[str], width: int) -> list[list[str]]:
    """The row, its first cell broken after dots into lines of at most ``width`` (a part
    longer than that is cut); the other cells on the first line."""
    lines = wrap_name(row[0], width)
    blank = [""] * (len(row) - 1)
    return [[lines[0], *row[1:]], *([ln, *blank] for ln in lines[1:])]


def _group_line(groups: list[tuple[str, list[str]]], widths: list[int]) -> str:
    parts, i = [], 0
    for label, cols in groups:
        span = sum(widths[i : i + len(cols)]) + 2 * (len(cols) - 1)
        i += len(cols)
        text = f" {label} " if label else ""
        parts.append(text.center(span, "-") if label else " " * span)
    return "  ".join(parts).rstrip()


def render(advice: Advice, wide: bool = False) -> str:
    """The whole report: a heading, the per-module table (``wide``: every figure; else the
    model-grad SQNR per candidate, lines of at most :data:`WIDTH`, and why below), its legend,
    the proposal, the prediction, the matmuls per format and the predicted speed."""
    width = None if wide else WIDTH
    if wide:
        table = _align(_groups(advice), [_row(advice, m) for m in advice.modules])
    else:
        table = _align(
            _narrow_groups(advice), [_narrow_row(advice, m) for m in advice.modules], width
        )
    speed = f"; speed on {advice.step.gpu}" if advice.step is not None else ""
    lines = [
        f"mixprec advise: {len(advice.modules)} modules, candidates "
        f"{', '.join(advice.candidates)}, region {format_dtype(advice.dtype)}, "
        f"{advice.passes} passes{speed}",
        "SQNR (signal-to-quantization-noise ratio) against float32, in dB: higher is better "
        "(one tensor rounded to bf16: about 47; to fp8: 21-29)",
        "",
        *table,
        *([] if wide else _why(advice)),
        "",
        *_legend(advice, wide),
        *_per_matmul(advice, width),
        "",
        f"policy:      {_policy_text(advice)}",
        f"region:      mixprec.autocast({advice.device_type!r}, dtype=torch."
        f"{str(advice.dtype).removeprefix('torch.')}, policy=...)",
    ]
    if advice.init_scale is not None:
        lines.append(f"init_scale:  {advice.init_scale:g} (mixprec.GradScaler(init_scale=...))")
    lines += [_prediction(advice), f"matmuls:     {matmul_summary(advice)}", _kept(advice)]
    if advice.measured_sqnr is not None:
        lines.append(f"measured:    {fmt_db(advice.measured_sqnr)} dB with the policy applied")
    lines += _model_check(advice)
    lines += _speed(advice)
    lines += [f"note:        {n}" for n in advice.notes]
    return "\n".join(w for line in lines for w in _fit(line, table))


def _fit(line: str, table: list[str]) -> list[str]:
    """A line of text wrapped at :data:`WIDTH` (a ``label:`` line under its text); the table's
    own lines as they are."""
    if len(line) <= WIDTH or line in table:
        return [line]
    indent = " " * 13 if line[:13].rstrip().endswith(":") else ""
    return textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_on_hyphens=False)


def _why(advice: Advice) -> list[str]:
    """Each module's reason, below the default table (the wide table has a column)."""
    lines = ["", "why:"]
    for m in advice.modules:
        lines += textwrap.wrap(
            f"{m.name}: {m.reason}", WIDTH, initial_indent="  ", subsequent_indent="    "
        )
    return lines


def _kept(advice: Advice) -> str:
    """The kept modules, with what "kept" means."""
    kept = advice.kept
    what = (
        f"(kept: out of every candidate, all its matmuls in {advice.kept_precision}; a module "
        "no candidate serves gets no rule and is not counted)"
    )
    if not kept:
        return f"kept:        no module {what}"
    names = ", ".join(kept[:4]) + (f" and {len(kept) - 4} more" if len(kept) > 4 else "")
    return f"kept:        {len(kept)} module{'s' if len(kept) > 1 else ''}: {names} {what}"


def _legend(advice: Advice, wide: bool) -> list[str]:
    return [w for line in _legend_lines(advice, wide) for w in textwrap.wrap(line, WIDTH)]


def _legend_lines(advice: Advice, wide: bool) -> list[str]:
    lines = [
        "model-grad: the whole model's gradient SQNR with only this module in the candidate "
        "(what the prediction adds up)"
        + (
            "; output, input-grad, weight-grad: the SQNR of the module's own output, input "
            "gradient and weight gradient"
            if wide
            else "; wide=True (mixprec advise --wide) adds each module's output, input-grad and "
            "weight-grad SQNR, its size, fp16 range and fp8 cast figures, and with a GPU each "
            "candidate's µs"
        )
    ]
    if _split_words(advice) and wide:
        lines.append(
            "a recipe measured per matmul: model-grad is its three matmuls' errors added (the "
            "table per matmul below); output from the pass with fprop alone in the recipe, "
            "input-grad and weight-grad from the pass with dgrad and wgrad in it"
        )
    if _timed(advice) and advice.step is not None:
        lines.append(
            f"µs: predicted time per step on {advice.step.gpu} (the module's three GEMMs "
            "and its casts; '-': the GPU has no kernel for that recipe: measured emulated, "
            "never chosen; blank: not timed alone, no Linear or conv GEMM)"
            if wide
            else f"µs: the decision's predicted time per step on {advice.step.gpu} (the "
            "module's three GEMMs and its casts; blank: no Linear or conv GEMM)"
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
    return lines + (_wide_legend(advice) if wide else [])


def _wide_legend(advice: Advice) -> list[str]:
    """The legend of the columns only the wide table has."""
    lines = []
    if _has_fp16(advice):
        lines.append(
            "fp16 range: outputs above 65504 (>max); non-zero gradients fp16 rounds to 0 "
            "without loss scaling (flush@1) and at init_scale (flush@scale)"
        )
    if _fp8_words(advice):
        lines.append(
            "<recipe> casts: with that candidate, the largest fraction over the operands (in: "
            "input, w: weight, go: output gradient) of values cast to the format's top bin "
            "(at-max: with amax scaling the largest value lands there, so a few is healthy, not "
            "clipping) and of non-zero values flushed to 0 (flush)"
        )
    return lines


def _split_words(advice: Advice) -> list[str]:
    """The candidates measured one matmul at a time."""
    return [
        w
        for w in advice.candidates
        if any((x := m.measurement(w)) is not None and x.matmuls for m in advice.modules)
    ]


def _per_matmul(advice: Advice, width: int | None) -> list[str]:
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
        "per matmul: the model-grad SQNR with only that matmul of the module in the recipe "
        "(fprop: the output's matmul, dgrad: the input gradient's, wgrad: the weight "
        "gradient's; dB; * the module's worst: the matmul that carries its error)"
    )
    return ["", *textwrap.wrap(head, WIDTH), *_align(groups, rows, width)]


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
        f"predicted:   {fmt_db(advice.predicted_sqnr)} dB whole-model gradient SQNR{status}; "
        f"{between(advice.region_sqnr)}"
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
