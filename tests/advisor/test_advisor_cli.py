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
    assert "[1/7] float32 reference" in err and "[7/7] every module in its cheapest" in err


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

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_advisor.py"
    spec = importlib.util.spec_from_file_location("bench_advisor", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for text in (
        "| advise, per module |",
        "| advise, per module + check |",
        "| advise, per matmul |",
        "| advise, per matmul + check |",
        "| fp8 |",
        "torchao",
        "fp16 target: kept",
        "overhead at every=100",
    ):
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


def test_help_spells_out_sqnr_and_shows_every_default() -> None:
    code, out, _ = _run(["advise", "--help"])
    assert code == 0
    text = " ".join(out.split())
    assert "signal-to-quantization-noise ratio" in text and "higher is better" in text
    assert "--min-sqnr DB" in out and "(default: none" in text
    assert "--keep-at-most K" in out and "(default: no limit)" in text
    assert "(default: fewest_kept)" in text and "h200-nvl" in text


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


FACTORY_TEXT = """
import torch
from helpers import WIDTH


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x = torch.randn(16, WIDTH)
    return model, x, lambda m, b: m(b).pow(2).mean()


def make_sized(width, depth=2):
    return make()


def broken():
    raise RuntimeError("the data folder is missing")
"""


def test_a_factory_file_imports_its_siblings(tmp_path: Path) -> None:
    _write(tmp_path, "helpers.py", "WIDTH = 8\n")
    factory = _write(tmp_path, "factory_sibling.py", FACTORY_TEXT)
    code, out, err = _run(["advise", f"{factory}:make", "--candidates", "bf16", "--no-progress"])
    assert code == 0, err
    assert "policy:" in out


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("make_sized", "needs arguments (width); the command line calls the factory with none"),
        ("broken", "raised RuntimeError: the data folder is missing"),
    ],
)
def test_factory_errors_are_one_line(tmp_path: Path, name: str, message: str) -> None:
    _write(tmp_path, "helpers.py", "WIDTH = 8\n")
    factory = _write(tmp_path, f"factory_{name}.py", FACTORY_TEXT)
    code, _, err = _run(["advise", f"{factory}:{name}", "--no-progress"])
    assert code == 1 and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_file_whose_import_fails_is_one_line(tmp_path: Path) -> None:
    factory = _write(tmp_path, "factory_orphan.py", "import no_such_sibling_xyz\n")
    code, _, err = _run(["advise", f"{factory}:make", "--no-progress"])
    assert code == 1 and "ModuleNotFoundError: No module named 'no_such_sibling_xyz'" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--plot", "out.txt"], "matplotlib cannot write 'txt'"),
        (["--plot", "out"], "a file without a suffix"),
        (["--gpu", "a100"], "'a100' is not a GPU the speed model knows"),
        (["--objective", "speed"], "--objective speed needs --gpu"),
        (["--objective", "sqnr", "--gpu", "b200"], "--objective sqnr and --min-speedup X go"),
        (["--min-speedup", "1.5"], "--objective sqnr and --min-speedup X go"),
    ],
)
def test_bad_options_are_refused_before_any_pass(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    pytest.importorskip("matplotlib", reason="the [plot] extra checks plot formats")
    if argv[0] == "--plot":
        argv = ["--plot", str(tmp_path / argv[1])]
    code, out, err = _run(["advise", FACTORY, *argv])
    assert code == 2 and message in err and out == ""


def test_gpu_and_speed_objective_from_the_command_line() -> None:
    argv = ["advise", FACTORY, "--candidates", "fp16", "--gpu", "h100", "--no-progress"]
    code, out, err = _run([*argv, "--objective", "speed", "--json"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["gpu"] == "h100" and doc["objective"] == "speed"
    assert doc["step"]["gpu"] == "H100 SXM" and doc["step"]["speedup"] > 0


def test_per_matmul_and_the_sqnr_objective_from_the_command_line() -> None:
    argv = ["advise", FACTORY, "--candidates", "fp8,bf16", "--gpu", "b200", "--no-progress"]
    code, out, err = _run([*argv, "--objective", "sqnr", "--min-speedup", "1.0", "--json"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["per_matmul"] is True and doc["target"]["min_speedup"] == 1.0
    assert doc["objective"] == "sqnr" and doc["step"]["speedup"] >= 1.0
    code, out, err = _run([*argv, "--whole-modules", "--json"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["per_matmul"] is False
    assert all(x["matmuls"] is None for m in doc["modules"] for x in m["measurements"])


def test_modules_split_at_commas_outside_a_globs_brackets() -> None:
    """A comma inside ``[...]`` belongs to the glob, as in a policy string."""
    argv = ["advise", "tests/advisor_models.py:small_task", "--candidates", "bf16", "--json"]
    code, out, err = _run([*argv, "--no-progress", "--modules", "[c,o]*, fc"])
    assert code == 0, err
    assert sorted(m["name"] for m in json.loads(out)["modules"]) == ["conv", "fc", "out"]
    code, out, err = _run([*argv, "--no-progress", "--modules", "[c,o]*"])
    assert code == 0, err
    assert sorted(m["name"] for m in json.loads(out)["modules"]) == ["conv", "out"]


def test_wide_prints_the_full_table_and_the_default_fits_100_columns() -> None:
    """--wide is advice.table(wide=True); the candidates may come in any order."""
    argv = ["advise", FACTORY, "--no-progress", "--gpu", "h100"]
    code, narrow, err = _run([*argv, "--candidates", "bf16,fp16"])
    assert code == 0, err
    code, wide, err = _run([*argv, "--candidates", "fp16,bf16", "--wide"])
    assert code == 0, err
    assert max(len(line) for line in narrow.splitlines()) <= 100
    header = next(line for line in wide.splitlines() if line.startswith("module"))
    assert {"model-grad", "output", "input-grad", "weight-grad", "why"} <= set(header.split())
    assert "weight-grad" not in narrow.split("model-grad:")[0]
    policy = [line for line in wide.splitlines() if line.startswith("policy:")]
    assert policy == [line for line in narrow.splitlines() if line.startswith("policy:")]
