"""benchmarks/bench_autocast.py runs in each of its modes (a smoke test: nothing is timed here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_autocast.py"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], "mixprec, no policy"),
        (["--construction"], "Policy(4 module rules, 2 op rules)"),
        (["--region"], "mixprec.autocast"),
        (["--reuse", "--uses", "2"], "saved for backward"),
    ],
)
def test_bench_autocast_modes_run(
    flags: list[str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = importlib.util.spec_from_file_location("bench_autocast", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["bench_autocast.py", "--rounds", "1", "--iters", "1", *flags])
    bench.main()
    out = capsys.readouterr().out
    assert expected in out
