"""The command line's conventions: every subcommand gets them from the main parser (--version,
--help with defaults and examples, usage on errors, one-line errors, stdout that cannot be
written, progress), and nothing is lost or left half-done (a figure that cannot be written, an
interrupted run, a huge --steps)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import mixprec
from mixprec import cli
from mixprec.cli import _output, main
from mixprec.cli._command import Command, CommandError

FAST = ["--steps", "2", "--no-progress"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error" in line]


def test_version() -> None:
    code, out, _ = _run(["--version"])
    assert code == 0
    assert out.strip() == f"mixprec {mixprec.__version__} (torch {torch.__version__})"


def test_help_shows_defaults_and_examples_without_markup() -> None:
    code, out, _ = _run(["demo", "--help"])
    assert code == 0
    for option, default in {
        "--device": "cpu",
        "--dtype": "float16",
        "--steps": "300",
        "--out": "mixprec-demo",
        "--seed": "0",
        "--inject-inf": "none",
    }.items():
        block = out[out.index(f"  {option}") :].split("\n  -")[0]
        assert f"(default: {default})" in " ".join(block.split()), block
    assert "examples:\n  mixprec demo\n" in out
    assert "0..steps-1" in out
    for markup in ("``", ":class:", ":func:", ":mod:", "`"):
        assert markup not in out, markup
    code, top, _ = _run(["--help"])
    assert code == 0 and "demo" in top and "examples:" in top and "--version" in top


def test_cross_option_errors_print_the_subcommands_usage() -> None:
    code, out, err = _run(["demo", "--steps", "5", "--inject-inf", "7"])
    assert code == 2 and out == ""
    assert err.startswith("usage: mixprec demo ")
    assert _error_lines(err) == [
        "mixprec demo: error: --inject-inf 7 is not a step of the run; use 0..4 (--steps 5)"
    ]


def test_unusable_device_is_one_short_line() -> None:
    code, _, err = _run(["demo", "--device", "mps"])
    assert code == 2
    (line,) = _error_lines(err)
    assert "mps" in line and "--device cpu" in line and len(line) < 200, line


def _demo_cmd(*argv: str) -> list[str]:
    return [sys.executable, "-m", "mixprec", "demo", *argv]


def test_figure_path_that_is_a_folder(tmp_path: Path) -> None:
    (tmp_path / "mixprec-demo.png").mkdir()
    code, out, err = _run(["demo", *FAST, "--out", str(tmp_path)])
    assert code == 1
    assert "fp16 + GradScaler" in out and "Figure:" not in out  # the table is complete
    (line,) = err.strip().splitlines()
    assert line.startswith("mixprec demo: error: the figure could not be written to ")
    assert "it is a folder" in line
    code, out, err = _run(["demo", *FAST, "--json", "--out", str(tmp_path)])
    doc = json.loads(out)
    assert code == 1 and doc["figure"] is None and "folder" in doc["figure_error"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixprec-demo.png"]  # no temp file


def test_figure_without_permission() -> None:
    """/sys refuses new folders even to root; without root the check refuses it up front."""
    code, out, err = _run(["demo", *FAST, "--out", "/sys/mixprec-demo-test"])
    if os.geteuid() == 0:
        assert code == 1 and "fp16 + GradScaler" in out
        (line,) = err.strip().splitlines()
        assert "could not be written" in line and "not permitted" in line
    else:
        assert code == 2 and "not writable" in err
    assert not Path("/sys/mixprec-demo-test").exists()


def test_failed_figure_leaves_no_empty_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mixprec.cli import demo

    def full_disk(results: Any, path: Path) -> Path:
        path.write_bytes(b"\x89PNG partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(demo, "write_figure", full_disk)
    out = tmp_path / "new" / "deeper"
    code, stdout, err = _run(["demo", *FAST, "--out", str(out)])
    assert code == 1 and "fp16 + GradScaler" in stdout and "No space left" in err
    assert not (tmp_path / "new").exists()


def test_write_file_replaces_only_with_a_complete_file(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "fig.png"

    def interrupted(tmp: Path) -> None:
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _output.write_file(target, interrupted)
    assert list(tmp_path.iterdir()) == []  # a/ and a/b/ were created, then removed
    _output.write_file(target, lambda tmp: tmp.write_text("one"))
    with pytest.raises(KeyboardInterrupt):
        _output.write_file(target, interrupted)
    assert target.read_text() == "one" and [p.name for p in target.parent.iterdir()] == ["fig.png"]
    assert target.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_full_stdout_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    full = open("/dev/full", "w")  # noqa: SIM115 (closed below)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", full)
    with contextlib.redirect_stderr(err):
        code = main(["demo", *FAST, "--no-plot"])
    monkeypatch.undo()
    full.close()  # would raise if the failed write were still buffered
    assert code == 1
    assert err.getvalue().splitlines() == [
        "mixprec demo: error: cannot write the results to standard output (No space left on device)"
    ]


def test_closed_pipe_on_stdout_is_a_one_line_error() -> None:
    proc = subprocess.Popen(
        _demo_cmd(*FAST, "--no-plot"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away, as `mixprec demo | head -0` would
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert err.splitlines() == [
        "mixprec demo: error: cannot write the results to standard output (Broken pipe)"
    ]


def test_huge_run_allocates_little_and_an_interrupt_leaves_nothing(tmp_path: Path) -> None:
    """--steps 1000000 starts at once with a small memory footprint (no per-step tensors up
    front); Ctrl-C exits with 130, one line, and no output folder."""
    out = tmp_path / "out"
    cmd = [*_demo_cmd("--steps", "1000000", "--out", str(out), "--json"), "--seed", "3"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
        # Ctrl-C as a terminal delivers it, also when the suite runs where SIGINT is ignored (a
        # background job, nohup), which the child would otherwise inherit.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stderr is not None and proc.stdout is not None
    first = proc.stderr.readline().decode()  # printed when the first run starts training
    assert first == "fp32: training 1000000 steps\n", first
    peak_kib = _peak_rss_kib(proc.pid)
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 130
    assert rest.splitlines() == ["mixprec demo: interrupted"]
    assert proc.stdout.read() == b""
    assert not out.exists()
    assert peak_kib < 1_500_000, f"peak RSS {peak_kib} KiB before the first step"


def _peak_rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmHWM:\s+(\d+) kB", status)
    assert match is not None
    return int(match.group(1))


def test_python_dash_m_runs_a_short_demo_without_importing_dynamo() -> None:
    """`python -m mixprec` works, and torch's optimizers, which import torch._dynamo (seconds)
    on their first call, do not in the demo: `--steps 1` takes about as long as importing
    torch (benchmarks/bench_cli.py measures it)."""
    cmd = [sys.executable, "-X", "importtime", "-m", "mixprec", "demo", "--steps", "3"]
    proc = subprocess.run(
        [*cmd, "--no-plot", "--no-progress"], capture_output=True, text=True, timeout=120, env=ENV
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fp16 + GradScaler" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert "torch" in imported and "mixprec.cli._output" in imported  # -X importtime worked
    assert "torch._dynamo" not in imported


def _echo(args: argparse.Namespace) -> int:
    from mixprec.cli._command import progress
    from mixprec.cli._output import emit

    with progress(args, 4, "echo") as bar:
        for _ in range(4):
            bar.update()
    emit(f"words: {' '.join(args.words)}")
    if args.fail:
        raise CommandError("it failed after printing")
    if args.interrupt:
        raise KeyboardInterrupt
    return 0


def _echo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("words", nargs="*", help="what to print")
    p.add_argument("--times", type=int, default=1, help="how often")
    p.add_argument("--fail", action="store_true", help="fail")
    p.add_argument("--interrupt", action="store_true", help="raise KeyboardInterrupt")


ECHO = Command(
    name="echo",
    summary="print words",
    description="Prints its words.",
    examples=("mixprec echo hi",),
    add_arguments=_echo_arguments,
    run=_echo,
    check=lambda a: "--times must be positive" if a.times < 1 else None,
    progress=True,
)


def test_a_second_subcommand_gets_the_conventions(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("mixprec.cli._echo_for_test")
    module.COMMAND = ECHO  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, "_echo_for_test"))
    code, out, _ = _run(["--help"])
    assert code == 0 and "echo" in out and "demo" in out
    code, out, _ = _run(["echo", "--help"])
    assert "(default: 1)" in out and "--no-progress" in out and "mixprec echo hi" in out
    code, _, err = _run(["echo", "--times", "0"])
    assert code == 2 and err.startswith("usage: mixprec echo")
    assert "mixprec echo: error: --times must be positive" in err
    code, out, err = _run(["echo", "a", "b", "--fail"])
    assert code == 1 and out == "words: a b\n"
    assert err.splitlines() == [
        "echo: training 4 steps",
        "echo: 1/4 (25%)",
        "echo: 2/4 (50%)",
        "echo: 3/4 (75%)",
        "echo: 4/4 (100%)",
        "mixprec echo: error: it failed after printing",
    ]
    code, _, err = _run(["echo", "--interrupt", "--no-progress"])
    assert code == 130 and err == "mixprec echo: interrupted\n"


def test_progress_bar_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm", reason="the [progress] extra is not installed")
    from mixprec.cli._command import progress

    args = argparse.Namespace(no_progress=False)
    for tty, expect_bar in ((True, True), (False, False)):
        err = io.StringIO()
        monkeypatch.setattr(err, "isatty", lambda tty=tty: tty)
        monkeypatch.setattr(sys, "stderr", err)
        with progress(args, 2, "run") as bar:
            bar.update()
            bar.update()
        monkeypatch.undo()
        assert ("it/s" in err.getvalue()) is expect_bar, err.getvalue()


@pytest.mark.parametrize(
    ("argv", "typo", "meant"),
    [
        (["demo", "--stpes", "3"], "--stpes", "--steps"),
        (["demo", "--jsno"], "--jsno", "--json"),
        (["advise", "--modles", "x", "m:f"], "--modles", "--modules"),
        (["advise", "--candidtes=fp8", "m:f"], "--candidtes", "--candidates"),
        (["dry-run", "--policy", "x", "--gpux", "h100", "m:f"], "--gpux", "--gpu"),
    ],
)
def test_a_mistyped_flag_gets_the_closest_option(
    argv: list[str], typo: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every command: an unrecognized flag is named with the option it most likely meant, under
    the command's own usage (status 2, nothing run)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{typo}: did you mean {meant}?" in err, err
    assert f"usage: mixprec {argv[0]}" in err


def test_an_unrecognized_positional_gets_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "3", "extra"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: extra" in err and "did you mean" not in err
