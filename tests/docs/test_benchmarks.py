"""The benchmark entry points run (smoke tests; nothing here measures speed)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_run_quick_prints_every_row():
    out = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--quick", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "threads 1" in out.stdout and "torch 2." in out.stdout
    rows = ("unscale+check (a)", "(b)", "(c)", "unscale+clip_grad_norm_", "clip in step", "train")
    for row in rows:
        assert row in out.stdout
    assert out.stdout.count("| ") > 7 * 6
    assert "skip decisions identical" in out.stdout


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("bench_*.py")))
def test_every_benchmark_takes_the_options_run_py_passes(script: str) -> None:
    """run.py runs each bench_*.py with --threads N after its own table."""
    out = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--threads" in out.stdout


def test_gpu_check_without_cuda_exits_cleanly(capsys, monkeypatch):
    gpu_check = load("gpu_check")
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert "CUDA is not available" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_gpu_check_differential_core_runs_on_cpu(monkeypatch):
    """The CUDA script's differential logic, exercised on the CPU for two optimizers."""
    gpu_check = load("gpu_check")
    subset = {k: gpu_check.OPTIMIZERS[k] for k in ("sgd-momentum-foreach", "adam-fused")}
    monkeypatch.setattr(gpu_check, "OPTIMIZERS", subset)
    rows, ok = gpu_check.differential(gpu_check.torch.device("cpu"))
    assert ok, "\n".join(rows)
    assert len(rows) == 2 + 2 * len(gpu_check.CLIPS)
