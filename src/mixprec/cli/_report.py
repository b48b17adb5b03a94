"""The demo's outputs for people (a table and a verdict) and for machines (JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from mixprec.cli._task import RunResult

__all__ = ["as_json", "headline", "table", "verdict"]

_COLUMNS = ("run", "test loss", "R²", "grads flushed", "skipped", "final scale", "wall s")


def _row(r: RunResult) -> tuple[str, ...]:
    flushed = "-" if r.flushed_fraction is None else f"{100 * r.flushed_fraction:.1f}%"
    scale = "-" if r.final_scale is None else f"{r.final_scale:.3g}"
    skipped = str(r.steps_skipped) if r.scaled else "-"
    return (r.name, f"{r.test_loss:.3e}", f"{r.r2:.3f}", flushed, skipped, scale, f"{r.wall_s:.1f}")


def table(results: list[RunResult]) -> str:
    """A plain-text table, one row per run."""
    rows = [_COLUMNS, *(_row(r) for r in results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]

    def fmt(row: tuple[str, ...]) -> str:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        return "  ".join(cells)

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(rows[0]), rule, *(fmt(row) for row in rows[1:])])


def headline(results: list[RunResult]) -> str:
    """The result in one sentence (the figure's title)."""
    ref, low, scaled = results
    lost = 100 * (low.flushed_fraction or 0)
    kept = 100 * (1 - (scaled.flushed_fraction or 0))
    short = {"float16": "fp16", "bfloat16": "bf16"}.get(low.dtype, low.dtype)
    if lost < 1:
        return (
            f"{short} loses no gradient to underflow ({lost:.1f}% of the weight-gradient "
            f"elements flushed to zero):\nno loss scaling needed (test R² {low.r2:.3f}, float32 "
            f"{ref.r2:.3f})"
        )
    outcome = "matched float32" if abs(scaled.r2 - ref.r2) < 0.01 else "reached"
    return (
        f"Without loss scaling, {short} flushed {lost:.1f}% of the weight-gradient elements to "
        f"zero (test R² {low.r2:.3f} vs {ref.r2:.3f} in float32);\nmixprec.GradScaler kept "
        f"{kept:.1f}% of them and {outcome} (R² {scaled.r2:.3f})"
    )


def verdict(results: list[RunResult]) -> str:
    """Two sentences on what the table shows."""
    ref, low, scaled = results
    lines = [
        f"Without loss scaling, {100 * (low.flushed_fraction or 0):.1f}% of the gradient "
        f"elements that are non-zero in float32 flushed to zero in {low.dtype} "
        f"(R² {low.r2:.3f} vs {ref.r2:.3f} in float32).",
        f"With mixprec.GradScaler, {100 * (scaled.flushed_fraction or 0):.1f}% flushed "
        f"(R² {scaled.r2:.3f}); {_skips(scaled)}",
    ]
    if low.dtype == "bfloat16":
        lines.append(
            "bfloat16 has float32's exponent range, so small gradients do not underflow and "
            "loss scaling is not needed (a power-of-two scale changes nothing)."
        )
    if scaled.injected_inf_at is not None:
        lines.append(f"An inf was injected into a gradient at step {scaled.injected_inf_at}.")
    return "\n".join(lines)


def _skips(r: RunResult) -> str:
    if not r.steps_skipped:
        return "no step was skipped."
    return (
        f"{r.steps_skipped} step(s) with an inf/NaN gradient were skipped (steps "
        f"{', '.join(map(str, r.skipped_steps[:8]))}{' ...' if r.steps_skipped > 8 else ''}) "
        "and the scale backed off each time."
    )


def as_json(
    config: dict[str, Any],
    results: list[RunResult],
    figure: str | None,
    figure_error: str | None = None,
) -> str:
    """Everything measured, as one JSON document."""
    doc = {
        "config": config,
        "runs": [asdict(r) for r in results],
        "figure": figure,
        "figure_error": figure_error,
    }
    return json.dumps(doc, indent=2)
