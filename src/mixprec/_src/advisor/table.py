"""The advisor's report as a text table."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from mixprec._src.autocast.rules import format_dtype

if TYPE_CHECKING:
    from mixprec._src.advisor.report import Advice, ModuleAdvice


def fmt_db(value: float | None) -> str:
    """An SQNR for a table cell: one decimal, ``inf``, ``-inf`` (inf/NaN) or ``-``."""
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.1f}"


def _pct(value: float) -> str:
    return "0" if value == 0 else f"{100 * value:.2g}%"


def _header(advice: Advice) -> list[str]:
    cols = ["module", "type", "params"]
    for word in advice.candidates:
        cols += [f"{word} model", "out", "in-grad", "w-grad"]
    if _has_fp16(advice):
        cols += ["fp16 >max", "flush@1", "flush@scale"]
    if _fp8_words(advice):
        cols += ["fp8 sat", "fp8 flush"]
    return [*cols, "decision", "why"]


def _fp8_words(advice: Advice) -> list[str]:
    return [w for w in advice.candidates if w.startswith("fp8")]


def _fp8_cells(advice: Advice, m: ModuleAdvice) -> list[str]:
    """The largest saturated and flushed fractions over the module's operands and fp8
    candidates, with the operand (in, w, go: input, weight, grad_output)."""
    worst = {"saturated": (0.0, ""), "flushed": (0.0, "")}
    for word in _fp8_words(advice):
        x = m.measurement(word)
        if x is None or x.fp8 is None:
            continue
        for short, operand in (("in", "input"), ("w", "weight"), ("go", "grad_output")):
            stats = getattr(x.fp8, operand)
            for key in worst:
                if getattr(stats, key) > worst[key][0]:
                    worst[key] = (getattr(stats, key), short)
    return [f"{_pct(v)} {op}".strip() for v, op in worst.values()]


def _has_fp16(advice: Advice) -> bool:
    return any(m.fp16 is not None for m in advice.modules)


def _row(advice: Advice, m: ModuleAdvice) -> list[str]:
    cells = [m.name, m.kind, f"{m.params:,}"]
    for word in advice.candidates:
        x = m.measurement(word)
        if x is None:
            cells += ["n/a", "", "", ""]
            continue
        cells += [
            fmt_db(x.model_grad_sqnr),
            fmt_db(x.output_sqnr),
            fmt_db(x.input_grad_sqnr),
            fmt_db(x.weight_grad_sqnr),
        ]
    if _has_fp16(advice):
        f = m.fp16
        cells += (
            ["", "", ""]
            if f is None
            else [str(f.output_overflow), _pct(f.flushed_unscaled), _pct(f.flushed_scaled)]
        )
    if _fp8_words(advice):
        cells += _fp8_cells(advice, m)
    return [*cells, m.choice, m.reason]


def _align(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [
            c.ljust(w) if i < 2 or i >= len(r) - 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def render(advice: Advice) -> str:
    """The whole report: a heading, the per-module table, the proposal and the prediction."""
    rows = [_header(advice), *(_row(advice, m) for m in advice.modules)]
    lines = [
        f"mixprec advise: {len(advice.modules)} modules, candidates "
        f"{', '.join(advice.candidates)}, region {format_dtype(advice.dtype)}, "
        f"{advice.mode} mode ({advice.passes} passes)",
        "SQNR in dB against float32; 'model' = whole-model gradient with only that module "
        "in the candidate",
        "",
        *_align(rows),
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
    lines += [f"note:        {n}" for n in advice.notes]
    return "\n".join(lines)


def _policy_text(advice: Advice) -> str:
    text = str(advice.policy)
    return text or f"(no rules: the whole region in {format_dtype(advice.dtype)})"


def _prediction(advice: Advice) -> str:
    target = []
    if advice.min_sqnr is not None:
        target.append(f">= {advice.min_sqnr:g} dB")
    if advice.keep_at_most is not None:
        target.append(f"at most {advice.keep_at_most} kept")
    status = (
        f" (target {', '.join(target)}: {'met' if advice.met else 'NOT met'})" if target else ""
    )
    return (
        f"predicted:   {fmt_db(advice.predicted_sqnr)} dB whole-model gradient SQNR, "
        f"{len(advice.kept)} kept in {advice.kept_precision}{status}; the ops between the "
        f"measured modules alone: {fmt_db(advice.region_sqnr)} dB"
    )
