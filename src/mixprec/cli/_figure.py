"""The demo's figure: loss curves of the three runs, and the scale with skipped steps marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixprec._src.scaling.telemetry import HistoryEntry
from mixprec.cli._task import RunResult

__all__ = ["PlotUnavailable", "write_figure"]

_COLORS = {"float32": "tab:blue", "unscaled": "tab:red", "scaled": "tab:green"}


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


def _label(r: RunResult) -> str:
    if r.flushed_fraction is None:
        return r.name
    return f"{r.name}: {100 * r.flushed_fraction:.1f}% of grad elements flushed to 0"


def _style(r: RunResult) -> dict[str, Any]:
    if r.scaled:  # dashed, so that float32 stays visible where the two curves coincide
        return {"color": _color(r), "linestyle": "--", "linewidth": 1.8}
    width = 3.0 if r.dtype == "float32" else 1.8
    return {"color": _color(r), "linewidth": width, "alpha": 0.8}


def write_figure(results: list[RunResult], path: Path) -> Path:
    """Draw the figure into ``path`` (PNG, Agg backend) and return it.

    Raises:
        PlotUnavailable: matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(
            "matplotlib is not installed, so no figure was drawn; install it with "
            "`pip install 'mixprec[plot]'`."
        ) from exc
    fig, (ax_loss, ax_scale) = plt.subplots(
        2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    window = max(1, len(results[0].losses) // 30)
    for r in results:
        steps = range(len(r.losses))
        ax_loss.plot(steps, r.losses, color=_color(r), alpha=0.2, linewidth=0.8)
        ax_loss.plot(steps, _smooth(r.losses, window), label=_label(r), **_style(r))
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("training loss (MSE)")
    ax_loss.set_title("Same model, data and seed: float32, low precision, low precision + scaler")
    ax_loss.legend()
    ax_loss.grid(True, which="both", alpha=0.3)
    _draw_scale(ax_scale, [r for r in results if r.scaled])
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _draw_scale(ax: Any, scaled: list[RunResult]) -> None:
    """The scaled run's scale per step with skipped steps marked: ``mixprec.plot``'s drawing."""
    from mixprec._src.plot import plot

    for r in scaled:
        skipped = set(r.skipped_steps)
        entries = [HistoryEntry(i, s, i in skipped) for i, s in enumerate(r.scales)]
        plot(entries, ax=ax, title=f"{r.name}: loss scale")
