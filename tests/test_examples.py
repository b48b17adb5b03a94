"""Every script in examples/ runs to completion (small sizes via MIXPREC_EXAMPLE_STEPS).

One runner process imports torch and mixprec once, then forks a child per example and runs the
script in it with ``runpy`` as ``__main__`` (its own process, output and exit status; no repeated
import cost). Where ``os.fork`` is missing, each example runs in a fresh interpreter instead.
Each example has a time limit; a child that exceeds it is killed with its process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.py"))
STEPS = "5"  # MIXPREC_EXAMPLE_STEPS for the examples that read it
PER_EXAMPLE_TIMEOUT_S = 120

RUNNER = r"""
import json, os, runpy, signal, subprocess, sys, time, traceback

logdir, timeout, paths = sys.argv[1], float(sys.argv[2]), sys.argv[3:]


def run_in_fork(path, log):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setpgid(0, 0)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.argv = [path]
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    start = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() - start > timeout:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.02)


def run_in_subprocess(path, log):
    with open(log, "w") as out:
        try:
            return subprocess.run(
                [sys.executable, path], stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return "timeout"


if hasattr(os, "fork"):
    import torch

    torch.set_num_threads(1)
    import mixprec  # noqa: F401  imported once, shared by every forked example
for path in paths:
    log = os.path.join(logdir, os.path.basename(path) + ".log")
    start = time.monotonic()
    rc = (run_in_fork if hasattr(os, "fork") else run_in_subprocess)(path, log)
    record = {"path": path, "rc": rc, "seconds": round(time.monotonic() - start, 2), "log": log}
    print(json.dumps(record), flush=True)
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    logdir = tmp_path_factory.mktemp("example-logs")
    env = {**os.environ, "MIXPREC_EXAMPLE_STEPS": STEPS, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-c", RUNNER, str(logdir), str(PER_EXAMPLE_TIMEOUT_S)]
    proc = subprocess.run(
        [*argv, *map(str, EXAMPLES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=PER_EXAMPLE_TIMEOUT_S * (len(EXAMPLES) + 1),
    )
    found = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    by_name = {Path(r["path"]).name: r for r in found}
    by_name["__runner__"] = {"rc": proc.returncode, "stderr": proc.stderr}
    return by_name


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 9, [p.name for p in EXAMPLES]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path: Path, results: dict[str, dict[str, Any]]) -> None:
    runner = results["__runner__"]
    assert path.name in results, f"the runner stopped before {path.name}: {runner['stderr']}"
    result = results[path.name]
    log = Path(result["log"]).read_text(errors="replace")
    assert result["rc"] == 0, f"{path.name} exited with {result['rc']}:\n{log[-3000:]}"
    assert "Traceback" not in log, log[-3000:]
