"""`mixprec advise MODULE:FACTORY`: the report, JSON, the plot, progress, and clear errors for
factories that do not exist or return the wrong thing."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from mixprec.cli import main

FACTORY = "tests/advisor_models.py:loud_task"


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_json_report_and_plot(tmp_path: Path) -> None:
    plot = tmp_path / "advice.png"
    argv = ["advise", FACTORY, "--candidates", "fp16", "--json", "--no-progress"]
    code, out, err = _run([*argv, "--plot", str(plot), "--check"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["policy"] == "loud.fc=fp32" and doc["kept"] == ["loud.fc"]
    assert doc["measured_sqnr"] is not None
    assert plot.stat().st_size > 1000
    assert err == ""


def test_table_with_progress_from_an_importable_module() -> None:
    code, out, err = _run(["advise", "tests.advisor_models:loud_task", "--candidates", "fp16"])
    assert code == 0, err
    assert "loud.fc=fp32" in out and "init_scale" in out
    assert "[1/6] float32 reference" in err and "[6/6]" in err


@pytest.mark.parametrize(
    ("target", "code", "message"),
    [
        ("loud_task", 2, "is not MODULE:FACTORY"),
        ("no_such_module_xyz:make", 1, "cannot import 'no_such_module_xyz'"),
        ("tests/nope.py:make", 1, "file tests/nope.py does not exist"),
        ("tests/advisor_models.py:nope", 1, "has no 'nope'; its functions and classes: "),
        ("tests/advisor_models.py:NOT_CALLABLE", 1, "is a int, not a function"),
        ("tests/advisor_models.py:not_a_triple", 1, "returned a 2-tuple; it must return"),
        ("tests/advisor_models.py:not_a_model", 1, "returned a str as the model"),
    ],
)
def test_bad_factories_exit_with_a_message(target: str, code: int, message: str) -> None:
    got, _, err = _run(["advise", target, "--no-progress"])
    assert got == code
    assert message in err and "Traceback" not in err
    assert err.startswith("usage:" if code == 2 else "mixprec advise: error:")


def test_bad_options_are_usage_errors() -> None:
    code, _, err = _run(["advise", FACTORY, "--keep-at-most", "-1"])
    assert code == 2 and "--keep-at-most -1" in err
    code, _, err = _run(["advise", FACTORY, "--candidates", "fp64", "--no-progress"])
    assert code == 1 and "unknown precision rule 'fp64'" in err


def test_benchmark_quick_prints_every_table(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_advisor.py"
    spec = importlib.util.spec_from_file_location("bench_advisor", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for text in ("| exact |", "| exact + check |", "| fp8 |", "torchao", "fp16 target: kept"):
        assert text in out, text
    assert "deterministic: yes" in out


def test_plot_into_a_new_folder_and_an_unwritable_one(tmp_path: Path) -> None:
    plot = tmp_path / "new" / "advice.svg"
    argv = ["advise", FACTORY, "--candidates", "fp16", "--no-progress", "--plot"]
    code, out, err = _run([*argv, str(plot)])
    assert code == 0, err
    assert plot.read_text().startswith("<?xml") and f"plot: {plot}" in out
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = _run([*argv, str(blocker / "advice.png")])
    assert code == 2 and "exists and is not a folder" in err
