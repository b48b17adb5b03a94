"""The advisor's plot: per-module gradient SQNR per candidate, the proposal marked.

matplotlib is imported when called (the ``[plot]`` extra), never at ``import mixprec``; the
figure is built without pyplot.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixprec._src.deps import require

if TYPE_CHECKING:
    from mixprec._src.advisor.report import Advice

_COLORS = ("tab:orange", "tab:blue", "tab:green", "tab:purple", "tab:brown")


def draw(advice: Advice, path: str | Path | None, ax: Any) -> Any:
    """Horizontal bars, one group per module (in execution order), one bar per candidate."""
    figure_mod = require("matplotlib.figure", "plot", "Advice.plot")
    if ax is None:
        height = 1.2 + 0.32 * len(advice.modules) * max(1, len(advice.candidates))
        fig = figure_mod.Figure(figsize=(8, min(height, 30)), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    left = _left_edge(advice)
    _bars(ax, advice, left)
    ax.set_xlim(left=left)
    if advice.min_sqnr is not None:
        ax.axvline(advice.min_sqnr, color="tab:red", linestyle="--", label="target (whole model)")
    ax.axvline(
        _finite(advice.predicted_sqnr),
        color="black",
        linestyle=":",
        label=f"predicted, proposal ({advice.predicted_sqnr:.1f} dB)",
    )
    ax.set_xlabel(
        "whole-model gradient SQNR with only this module in the candidate (dB; outlined: chosen)"
    )
    ax.set_title(f"mixprec advise: {str(advice.policy) or 'no rules'}", fontsize=9)
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def _finite(db: float, cap: float = 120.0) -> float:
    return cap if db == math.inf else (0.0 if db == -math.inf else db)


def _left_edge(advice: Advice) -> float:
    """Start the axis a little below the smallest finite figure, so differences show."""
    values = [
        x.model_grad_sqnr
        for m in advice.modules
        for x in m.measurements
        if math.isfinite(x.model_grad_sqnr)
    ]
    values += [v for v in (advice.min_sqnr, advice.predicted_sqnr) if v is not None]
    finite = [v for v in values if math.isfinite(v)]
    return max(0.0, 5.0 * math.floor((min(finite) - 5.0) / 5.0)) if finite else 0.0


def _bars(ax: Any, advice: Advice, left: float) -> None:
    n = max(1, len(advice.candidates))
    width = 0.8 / n
    for j, word in enumerate(advice.candidates):
        ys, xs, edges = [], [], []
        for i, m in enumerate(advice.modules):
            x = m.measurement(word)
            if x is None:
                continue
            y = i - 0.4 + width * (j + 0.5)
            if x.model_grad_sqnr == -math.inf:
                ax.annotate(
                    "inf/NaN",
                    (left, y),
                    xytext=(3, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize=7,
                    color="tab:red",
                )
                continue
            ys.append(y)
            xs.append(_finite(x.model_grad_sqnr))
            edges.append("black" if m.choice == word else "none")
        ax.barh(
            ys,
            xs,
            height=width,
            color=_COLORS[j % len(_COLORS)],
            edgecolor=edges,
            linewidth=1.5,
            label=word,
        )
    labels = [
        f"{m.name}  [{'kept ' if m.choice == advice.kept_precision else ''}{m.choice}]"
        for m in advice.modules
    ]
    ax.set_yticks(range(len(advice.modules)), labels, fontsize=8)
