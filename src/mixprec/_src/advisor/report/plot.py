"""The advisor's plot: per-module gradient SQNR per candidate, the proposal marked, and, with a
GPU, each module's predicted time in the proposal against bf16.

matplotlib is imported when called (the ``[plot]`` extra), never at ``import mixprec``; the
figure is built without pyplot. The SQNR axis starts at 0 dB, so that bar lengths compare.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixprec._src.advisor.report.matmuls import summary as matmul_summary
from mixprec._src.deps import require

if TYPE_CHECKING:
    from mixprec._src.advisor.report.advice import Advice

_COLORS = ("tab:orange", "tab:blue", "tab:green", "tab:purple", "tab:brown")


def draw(advice: Advice, path: str | Path | None, ax: Any) -> Any:
    """Horizontal bars, one group per module (in execution order), one bar per candidate."""
    figure_mod = require("matplotlib.figure", "plot", "Advice.plot")
    timed = advice.step is not None
    if ax is None:
        height = 1.6 + 0.32 * len(advice.modules) * max(1, len(advice.candidates))
        fig = figure_mod.Figure(figsize=(13 if timed else 8, min(height, 30)), layout="constrained")
        ax = fig.add_subplot(1, 2, 1) if timed else fig.add_subplot()
        time_ax = fig.add_subplot(1, 2, 2, sharey=ax) if timed else None
    else:
        fig, time_ax = ax.figure, None
    _sqnr_panel(ax, advice)
    if time_ax is not None:
        _time_panel(time_ax, advice)
    fig.suptitle(
        f"mixprec advise: {str(advice.policy) or 'no rules'}\nmatmuls: {matmul_summary(advice)}",
        fontsize=9,
    )
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def _sqnr_panel(ax: Any, advice: Advice) -> None:
    _bars(ax, advice)
    right = max([_finite(x) for x in _values(advice)] + [10.0])
    ax.set_xlim(0.0, 5.0 * math.ceil(right / 5.0 + 0.5))
    if advice.min_sqnr is not None:
        ax.axvline(advice.min_sqnr, color="tab:red", linestyle="--", label="target (whole model)")
    ax.axvline(
        _finite(advice.predicted_sqnr),
        color="black",
        linestyle=":",
        label=f"predicted, proposal ({advice.predicted_sqnr:.1f} dB)",
    )
    ax.set_xlabel(
        "whole-model gradient SQNR with only this module in the candidate\n"
        "(dB against float32, higher is better; outlined: chosen)"
    )
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8)


def _values(advice: Advice) -> list[float]:
    found = [x.model_grad_sqnr for m in advice.modules for x in m.measurements]
    found += [v for v in (advice.min_sqnr, advice.predicted_sqnr) if v is not None]
    return [v for v in found if math.isfinite(v)]


def _finite(db: float, cap: float = 120.0) -> float:
    return cap if db == math.inf else (0.0 if db == -math.inf else db)


def _bars(ax: Any, advice: Advice) -> None:
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
                    (0, y),
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
    ax.set_yticks(
        range(len(advice.modules)),
        [_label(advice, i) for i in range(len(advice.modules))],
        fontsize=8,
    )


def _label(advice: Advice, i: int) -> str:
    m = advice.modules[i]
    if not m.served:
        return f"{m.name}  [no candidate: region]"
    kept = "kept " if m.choice == advice.kept_precision else ""
    return f"{m.name}  [{kept}{m.choice}]"


def _time_panel(ax: Any, advice: Advice) -> None:
    """Each module's predicted µs per step: the proposal against bf16."""
    step = advice.step
    assert step is not None
    ys = range(len(advice.modules))
    chosen = [0.0 if m.time is None else m.time.total * 1e6 for m in advice.modules]
    base = [
        0.0 if m.kept_time is None else _bf16_us(advice, i) for i, m in enumerate(advice.modules)
    ]
    ax.barh([y - 0.2 for y in ys], base, height=0.4, color="tab:gray", label="bf16")
    ax.barh([y + 0.2 for y in ys], chosen, height=0.4, color="tab:green", label="proposal")
    for y, m in zip(ys, advice.modules, strict=True):
        if m.time is None:  # no bar: a module without a Linear or conv GEMM is not timed at all
            ax.text(0.0, y, " not timed alone", va="center", fontsize=7, color="tab:gray")
    left_out = f", {len(step.left_out)} modules not timed" if step.left_out else ""
    ax.set_xlabel(
        f"predicted µs per step on {step.gpu} (three GEMMs + casts)\n"
        f"step's matmuls: {step.proposal * 1e6:.3g} µs vs {step.baseline * 1e6:.3g} µs in bf16 "
        f"({step.speedup:.2f}x{left_out})"
    )
    ax.tick_params(axis="y", labelleft=False)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8)


def _bf16_us(advice: Advice, i: int) -> float:
    """The module's time in the region's 16-bit dtype: its kept time around fp8, else its
    16-bit candidate's."""
    m = advice.modules[i]
    if advice.kept_precision != "fp32" and m.kept_time is not None:
        return m.kept_time.total * 1e6
    timed = [x.time for x in m.measurements if x.time is not None and x.fp8 is None]
    return timed[0].total * 1e6 if timed else 0.0
