"""``mixprec.plot``: the scale history as a figure and a PNG file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.errors import ConfigError

pytest.importorskip("matplotlib", reason="needs the [plot] extra")


def trained_scaler(steps: int = 12) -> mixprec.GradScaler:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = mixprec.GradScaler(growth_interval=3, history=64)
    for i in range(steps):
        x = torch.randn(8, 4) * (1e5 if i in (4, 9) else 1.0)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler


def test_plot_draws_the_history_and_writes_a_png(tmp_path: Path) -> None:
    scaler = trained_scaler()
    history = scaler.history()
    path = tmp_path / "scale.png"
    fig = mixprec.plot(scaler, path)

    (ax,) = fig.axes
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [e.iteration for e in history]
    assert list(line.get_ydata()) == [e.scale for e in history]
    skipped = [(e.iteration, e.scale) for e in history if e.skipped]
    assert len(skipped) >= 2
    assert [tuple(p) for p in ax.collections[0].get_offsets()] == skipped
    assert ax.get_yscale() == "log"

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (800, 350)  # figsize (8, 3.5) at 100 dpi


def test_plot_into_given_axes_from_a_list_of_entries() -> None:
    from matplotlib.figure import Figure

    entries = trained_scaler().history()
    fig = Figure()
    ax = fig.add_subplot()
    assert mixprec.plot(entries, ax=ax, title="run 7") is fig
    assert ax.get_title() == "run 7"


def test_plot_without_history_says_how_to_get_one() -> None:
    with pytest.raises(ConfigError, match=r"GradScaler\(history=N\)"):
        mixprec.plot(mixprec.GradScaler())
    with pytest.raises(ConfigError, match="takes a GradScaler or a list"):
        mixprec.plot(3.0)


def test_import_mixprec_does_not_import_optional_packages() -> None:
    code = (
        "import sys, mixprec; "
        "print(sorted(m for m in ('matplotlib', 'tensorboard', 'accelerate', "
        "'pytorch_lightning', 'lightning') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
