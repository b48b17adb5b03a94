"""``mixprec.plot``: the scale history with the skipped iterations marked (matplotlib).

matplotlib is imported when :func:`plot` is called, never at ``import mixprec``; install it with
``pip install 'mixprec[plot]'``. The figure is built without pyplot, so it works on headless
machines and does not touch pyplot's global state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mixprec._src.deps import require
from mixprec._src.scaling.telemetry import HistoryEntry
from mixprec.errors import ConfigError


def plot(
    source: Any,
    path: str | Path | None = None,
    *,
    ax: Any = None,
    title: str = "mixprec loss scale",
) -> Any:
    """Draw the loss scale per iteration, skipped iterations marked with red crosses.

    Args:
        source: a :class:`~mixprec.GradScaler` built with ``history=N`` (its
            :meth:`~mixprec.GradScaler.history` is drawn) or a sequence of
            :class:`~mixprec.types.HistoryEntry`.
        path: where to write the image (the format follows the suffix: ``.png``, ``.svg``,
            ``.pdf``); nothing is written when None.
        ax: a matplotlib ``Axes`` to draw into (default: a new figure).
        title: the axes' title.

    Returns:
        The matplotlib ``Figure`` (Jupyter displays it).

    Raises:
        ConfigError: there is no history to draw (the scaler was built without ``history=``,
            or no update happened yet).
        ImportError: matplotlib is not installed.

    Example:
        >>> import torch, mixprec
        >>> scaler = mixprec.GradScaler(history=100)
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> for _ in range(3):
        ...     scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
        ...     scaler.step(opt)
        ...     scaler.update()
        >>> fig = mixprec.plot(scaler)  # or mixprec.plot(scaler, "scale.png")

    Host sync: one (reading the history).
    """
    entries = _entries(source)
    figure_mod = require("matplotlib.figure", "plot", "mixprec.plot")
    if ax is None:
        fig = figure_mod.Figure(figsize=(8, 3.5), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    _draw(ax, entries, title)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def _entries(source: Any) -> Sequence[HistoryEntry]:
    history = getattr(source, "history", None)
    entries = history() if callable(history) else source
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence):
        raise ConfigError(
            f"plot() takes a GradScaler or a list of HistoryEntry, got {type(source).__name__}."
        )
    if not entries:
        raise ConfigError(
            "There is no scale history to plot: build the scaler with "
            "mixprec.GradScaler(history=N) to keep the last N iterations, and plot after at "
            "least one scaler.update()."
        )
    return entries


def _draw(ax: Any, entries: Sequence[HistoryEntry], title: str) -> None:
    iterations = [e.iteration for e in entries]
    scales = [e.scale for e in entries]
    skipped = [e for e in entries if e.skipped]
    ax.step(iterations, scales, where="post", color="tab:blue", label="scale")
    if skipped:
        ax.scatter(
            [e.iteration for e in skipped],
            [e.scale for e in skipped],
            marker="x",
            color="tab:red",
            zorder=3,
            label=f"skipped step ({len(skipped)})",
        )
    ax.set_yscale("log", base=2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss scale")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best")
