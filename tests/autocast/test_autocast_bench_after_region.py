"""benchmarks/bench_after_region.py runs (a smoke test: nothing is timed here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_after_region.py"


def test_bench_after_region_runs() -> None:
    args = [sys.executable, str(BENCH), "--rounds", "1", "--iters", "2"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    for row in ("after a policy region / before", "A/A control", "pre-#36"):
        assert row in done.stdout, done.stdout
