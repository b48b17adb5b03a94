"""benchmarks/fp8_gpt_gap.py runs end to end on a tiny configuration (a smoke test: the figures
of docs/fp8.md come from its full run; nothing here checks one machine's digits)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_gpt_gap.py"


def _load():
    spec = importlib.util.spec_from_file_location("fp8_gpt_gap", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_has_every_configuration_and_the_advised_policy(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    gap = _load()
    argv = ["--steps", "2", "--seeds", "0", "--jobs", "1", "--width", "64", "--seq", "16"]
    argv += ["--batch", "4", "--only", "mxfp8", "nvfp4", "advised"]
    assert gap.main([*argv, "--save", str(tmp_path / "run.json")]) == 0
    out = capsys.readouterr().out
    assert gap.main(["--merge", str(tmp_path / "run.json")]) == 0
    merged = capsys.readouterr().out
    assert merged[merged.index("| configuration") :] == out[out.index("| configuration") :]
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) == {"configuration", "bf16", "mxfp8", "nvfp4", "advised"}
    for name in ("mxfp8", "nvfp4", "advised"):
        held = float(rows[name].split("|")[2])
        assert math.isfinite(held) and 0 < held < 10, rows[name]
    assert "seed 0 all-nvfp4 on the first batch: gradient SQNR predicted" in out
    assert "seed 0 advised: min_sqnr" in out and "nn.Linear=" in out


def test_the_schedule_warms_up_then_decays_to_a_tenth() -> None:
    gap = _load()
    args = gap.argparse.Namespace(steps=150, lr=1.0)
    lrs = [gap.lr_at(step, args) for step in range(150)]
    top = lrs.index(max(lrs))
    assert lrs[0] < lrs[top] == pytest.approx(1.0) and top == 150 // 15 - 1
    assert all(a >= b for a, b in zip(lrs[top:], lrs[top + 1 :], strict=False))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_the_per_matmul_benchmark_prints_every_table(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """benchmarks/fp8_per_matmul.py on a tiny configuration: every configuration's gap, both
    policies with their predicted speedups, the schedule's table, which matmul carries what."""
    spec = importlib.util.spec_from_file_location(
        "fp8_per_matmul", SCRIPT.with_name("fp8_per_matmul.py")
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--steps", "2", "--seeds", "0", "--jobs", "1", "--width", "64", "--seq", "16"]
    argv += ["--batch", "4", "--advise-batch", "8"]
    assert bench.main([*argv, "--save", str(tmp_path / "run.json")]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")}
    assert {"nvfp4", "per-module", "per-matmul", "schedule"} <= rows
    assert "schedule: nvfp4, then bf16 forward matmuls from step 2" in out
    assert "which matmul carries the error" in out and "| lm_head | nvfp4 |" in out
    assert bench.main(["--merge", str(tmp_path / "run.json")]) == 0
    merged = capsys.readouterr().out
    assert merged[merged.index("| configuration") :] == out[out.index("| configuration") :]
