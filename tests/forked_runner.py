"""Run Python scripts, each in its own forked process; and read the ```python blocks of Markdown.

Used by tests/docs/test_examples.py and tests/docs/test_doc_snippets.py (each doc snippet written to
a
script of its own) through a subprocess::

    python tests/forked_runner.py LOGDIR TIMEOUT_S script PATH...

This process imports torch and mixprec once (one thread, before any parallel region, so forking
is safe), then forks a child per PATH: the child redirects its output to LOGDIR/<name>.log and
runs the script with ``runpy`` as ``__main__``. A child that exceeds TIMEOUT_S is killed with
its process group. One JSON line per PATH goes to stdout: {"path", "rc", "seconds", "log"}.
Without ``os.fork`` each PATH runs in a fresh interpreter instead (slower, same result).

Markdown: a block whose first line is ``# doc: no-run (reason)`` is not run; the reason is
required.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import textwrap
import time
import traceback

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)\s*(?P<info>[^\n`]*)$")
NO_RUN = re.compile(r"^#\s*doc:\s*no-run\b(?P<reason>.*)$")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ```python (or ```py) blocks of a Markdown text: (first code line, 1-based; code)."""
    blocks: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group("fence"), (m.group("info").split() or [""])[0].lower()
        start, i = i + 1, i + 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        if lang in ("python", "py", "python3"):
            blocks.append((start + 1, textwrap.dedent("\n".join(lines[start:i]))))
        i += 1
    return blocks


def no_run_reason(code: str) -> str | None:
    """The reason of a ``# doc: no-run`` marker on the block's first line ("" if none given),
    or None when the block runs."""
    first = code.lstrip("\n").split("\n", 1)[0].strip()
    m = NO_RUN.match(first)
    if m is None:
        return None
    return m.group("reason").strip(" \t:-—()")


def run_script(path: str) -> int:
    sys.argv = [path]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    runpy.run_path(path, run_name="__main__")
    return 0


def child(path: str, mode: str, log: str) -> None:
    code = 1
    try:
        os.setpgid(0, 0)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = run_script(path)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_in_fork(path: str, mode: str, log: str, timeout: float) -> int | str:
    pid = os.fork()
    if pid == 0:
        child(path, mode, log)
    start = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() - start > timeout:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.02)


def run_in_subprocess(path: str, mode: str, log: str, timeout: float) -> int | str:
    argv = [sys.executable, path]
    with open(log, "w") as out:
        try:
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout"
    return proc.returncode


def run_files(
    paths: list[str], mode: str, logdir: str, timeout: float, env: dict[str, str] | None = None
) -> dict[str, dict[str, object]]:
    """Run this file as a subprocess on ``paths``; results by file name, plus ``"__runner__"``
    (its exit status and stderr, to explain a file that has no result)."""
    argv = [sys.executable, os.path.abspath(__file__), logdir, str(timeout), mode, *paths]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    limit = timeout * (len(paths) + 1)
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=limit)
    found = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    results: dict[str, dict[str, object]] = {os.path.basename(r["path"]): r for r in found}
    results["__runner__"] = {"rc": proc.returncode, "stderr": proc.stderr}
    return results


def main(argv: list[str]) -> int:
    logdir, timeout, mode, paths = argv[0], float(argv[1]), argv[2], argv[3:]
    forking = hasattr(os, "fork")
    if forking:
        import torch

        torch.set_num_threads(1)
        import mixprec  # noqa: F401  imported once, shared by every forked child
    for path in paths:
        log = os.path.join(logdir, os.path.basename(path) + ".log")
        start = time.monotonic()
        run = run_in_fork if forking else run_in_subprocess
        rc = run(path, mode, log, timeout)
        record = {"path": path, "rc": rc, "seconds": round(time.monotonic() - start, 2)}
        print(json.dumps({**record, "log": log}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
