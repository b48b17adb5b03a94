"""The demo's figure: the cause (the gradients against the low precision's range, without and with
the scale), the flushed fraction over the steps, the scale with its skipped steps, the losses.

Built without pyplot (``matplotlib.figure.Figure``), so it works headless and leaves pyplot's
global state alone.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from mixprec._src.scaling.telemetry import HistoryEntry
from mixprec._src.torch_compat import public_attr
from mixprec.cli._report import headline
from mixprec.cli._task import GROWTH_INTERVAL, RunResult

__all__ = ["PlotUnavailable", "write_figure"]

_COLORS = {"float32": "tab:blue", "unscaled": "tab:red", "scaled": "tab:green"}
_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_INJECTED = "darkviolet"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (the ``[plot]`` extra)."""


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _color(r: RunResult) -> str:
    return _COLORS["scaled" if r.scaled else "float32" if r.dtype == "float32" else "unscaled"]


def _figure_class() -> Any:
    try:
        import matplotlib  # noqa: F401 (raises first when matplotlib is missing)
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailable(
            "matplotlib is not installed, so no figure was drawn; install it with "
            "`pip install 'mixprec[plot]'`."
        ) from exc
    return Figure


def write_figure(results: list[RunResult], path: Path) -> Path:
    """Draw the figure of the three runs into ``path`` (PNG) and return it.

    Raises:
        PlotUnavailable: matplotlib is missing.
    """
    fig = _figure_class()(figsize=(14, 12.5))  # fixed margins: constrained layout is slow
    _, low, scaled = results
    fig.suptitle(headline(results), fontsize=14, fontweight="bold", y=0.985)
    grid = fig.add_gridspec(
        3,
        2,
        height_ratios=[1.15, 1, 1],
        left=0.075,
        right=0.985,
        top=0.91,
        bottom=0.05,
        hspace=0.42,
        wspace=0.16,
    )
    hist_low = fig.add_subplot(grid[0, 0])
    hist_scaled = fig.add_subplot(grid[0, 1], sharex=hist_low)
    _draw_histogram(hist_low, low)
    _draw_histogram(hist_scaled, scaled)
    _draw_flushed(fig.add_subplot(grid[1, 0]), [low, scaled])
    _draw_scale(fig.add_subplot(grid[1, 1]), scaled)
    _draw_losses(fig.add_subplot(grid[2, :]), results)
    fig.savefig(path, dpi=100, format="png")
    return path


def _ranges(dtype: torch.dtype) -> list[tuple[float, float, str, str]]:
    """(log2 from, log2 to, colour, label) of what ``dtype`` does with a magnitude."""
    info = torch.finfo(dtype)
    sub, normal, top = (math.log2(v) for v in (info.tiny * info.eps, info.tiny, info.max))
    name = _SHORT[str(dtype).removeprefix("torch.")]
    return [
        (-math.inf, sub, "#f4a6a6", f"below 2$^{{{sub:.0f}}}$: {name} rounds to 0"),
        (sub, normal, "#fbd38d", f"2$^{{{sub:.0f}}}$..2$^{{{normal:.0f}}}$: subnormal, fewer bits"),
        (normal, top, "#b7e4c7", f"{name}'s normal range"),
        (top, math.inf, "#e05d5d", f"above {_number(info.max)}: overflows to inf"),
    ]


def _number(value: float) -> str:
    return f"{value:g}" if value < 1e6 else f"{value:.2e}"


def _draw_histogram(ax: Any, r: RunResult) -> None:
    hist = r.gradients
    assert hist is not None
    low = hist.log2_low
    high = low + len(hist.outputs)
    total = max(sum(hist.outputs) + sum(hist.weights), 1)
    outputs = [100 * c / total for c in hist.outputs]
    both = [100 * (a + b) / total for a, b in zip(hist.outputs, hist.weights, strict=True)]
    edges = range(low, high + 1)
    ax.stairs(both, edges, fill=True, color="#1f3b73", zorder=3, label="w.r.t. weights")
    ax.stairs(outputs, edges, fill=True, color="#6c8ebf", zorder=3, label="w.r.t. layer outputs")
    bars = ax.legend(loc="upper right", title="gradients", fontsize=8.5, title_fontsize=9)
    patches = []
    for start, stop, color, label in _ranges(public_attr(torch, r.dtype)):
        counts = [a + b for a, b in zip(hist.outputs, hist.weights, strict=True)]
        inside = sum(c for k, c in enumerate(counts, low) if start <= k < stop)
        patch = ax.axvspan(max(start, low), min(stop, high), color=color, zorder=1)
        patch.set_label(f"{label}: {100 * inside / total:.1f}% of the values")
        patches.append(patch)
    ax.legend(handles=patches, loc="upper left", fontsize=8.5, framealpha=0.95)
    ax.add_artist(bars)
    ax.set_xlim(low, high)
    ax.set_ylim(0, max(both) * 1.55)
    ticks = range(low - low % 8, high + 1, 8)
    ax.set_xticks(list(ticks), [f"2$^{{{k}}}$" for k in ticks])
    ax.set_ylabel("% of gradient values")
    scaled = " × loss scale" if r.scaled else ""
    ax.set_xlabel(
        f"|gradient|{scaled}, w.r.t. layer outputs and weights, in float32 "
        f"({len(r.probe_steps)} steps)"
    )
    ax.set_title(_histogram_title(r), fontsize=11)
    if r.dtype == "bfloat16" and not r.scaled:
        _bf16_note(ax)


def _bf16_note(ax: Any) -> None:
    """Why bf16 needs no scaler, right of the bars, where the unscaled panel is empty."""
    ax.text(
        0.97,
        0.5,
        "bfloat16 has float32's exponent range\n(normal down to 2$^{-126}$): nothing\n"
        "underflows, so no scaler is needed",
        transform=ax.transAxes,
        ha="right",
        fontsize=10,
        bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.9},
        zorder=5,
    )


def _histogram_title(r: RunResult) -> str:
    hist = r.gradients
    assert hist is not None
    name = _SHORT[r.dtype]
    sub = _ranges(public_attr(torch, r.dtype))[0][1]
    counts = [a + b for a, b in zip(hist.outputs, hist.weights, strict=True)]
    below = sum(c for k, c in enumerate(counts, hist.log2_low) if k < sub) / max(sum(counts), 1)
    if not r.scaled:
        if below >= 0.01:
            return f"The cause: without scaling, most gradients are too small for {name}"
        return f"Without scaling: every gradient is within {name}'s range"
    probed = [r.scales[s] for s in r.probe_steps if s < len(r.scales)]
    span = f"2$^{{{math.log2(min(probed)):.0f}}}$..2$^{{{math.log2(max(probed)):.0f}}}$"
    lead = "The fix: GradScaler" if r.dtype == "float16" else "With GradScaler, for nothing:"
    return f"{lead} multiplies them by the loss scale ({span}) first"


def _draw_flushed(ax: Any, runs: list[RunResult]) -> None:
    for r in runs:
        ax.plot(
            r.probe_steps,
            [100 * f for f in r.flushed_by_probe],
            marker="o",
            markersize=4,
            color=_color(r),
            label=f"{r.name}: {100 * (r.flushed_fraction or 0):.1f}% over the run",
        )
    top = max((100 * f for r in runs for f in r.flushed_by_probe), default=0.0)
    ax.set_ylim(0, max(1.0, top * 1.1))
    ax.set_xlabel("step")
    ax.set_ylabel("% of weight-gradient elements flushed to 0")
    ax.set_title(
        f"Weight-gradient elements that are 0 in {_SHORT[runs[0].dtype]}, not in float32 "
        f"({len(runs[0].probe_steps)} measured steps):\nfewer than the values below its range "
        "above, since a weight gradient sums many products",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=9)


def _draw_scale(ax: Any, r: RunResult) -> None:
    """The scale per step, overflow skips marked by ``mixprec.plot``, the injected one apart."""
    from mixprec._src.plot import plot

    skipped = set(r.skipped_steps) - {r.injected_inf_at}
    entries = [HistoryEntry(i, s, i in skipped) for i, s in enumerate(r.scales)]
    plot(entries, ax=ax)
    inj = r.injected_inf_at
    if inj is not None and inj < len(r.scales):
        ax.scatter(
            [inj],
            [r.scales[inj]],
            marker="*",
            s=220,
            color=_INJECTED,
            zorder=4,
            label=f"injected inf at step {inj} (skipped)",
        )
    ax.set_xlabel("step")
    ax.set_title(
        f"{r.name}: the loss scale doubles after {GROWTH_INTERVAL} clean steps\n"
        f"(growth_interval={GROWTH_INTERVAL} is a demo setting; torch's default is 2000)",
        fontsize=11,
    )
    handles, labels = ax.get_legend_handles_labels()
    labels = [_scale_label(text) for text in labels]
    ax.legend(handles, labels, loc="lower right", fontsize=9)


def _scale_label(text: str) -> str:
    if text.startswith("skipped step"):  # mixprec.plot's label: "skipped step (N)"
        return "gradients overflowed: step skipped, scale halved " + text.removeprefix(
            "skipped step "
        )
    return text


def _draw_losses(ax: Any, results: list[RunResult]) -> None:
    window = max(1, len(results[0].losses) // 30)
    for i, r in enumerate(results):
        steps = range(len(r.losses))
        faint = "each step's loss (faint)" if i == 0 else None
        ax.plot(steps, r.losses, color=_color(r), alpha=0.25, linewidth=0.8, label=faint)
        style: dict[str, Any] = {"color": _color(r), "linewidth": 1.8}
        if r.scaled:  # dashed, so that float32 stays visible where the two curves coincide
            style["linestyle"] = "--"
        elif r.dtype == "float32":
            style["linewidth"] = 3.0
        label = f"{r.name}: test R² {r.r2:.3f} (mean over {window} steps)"
        ax.plot(steps, _smooth(r.losses, window), label=label, **style)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (MSE)")
    ax.set_title(
        "The effect: training loss of the three runs (same initial model, data and batch order)"
    )
    ax.legend(loc="best")
    ax.grid(True, which="both", alpha=0.3)
