"""Run Python scripts, each in its own forked process; and read the ```python blocks of Markdown.

Used by tests/docs/test_examples.py and tests/docs/test_doc_snippets.py (each doc snippet written to
a script of its own) through ``ForkPool``, which starts runner processes::

    python tests/forked_runner.py LOGDIR TIMEOUT_S serve

A runner imports torch and mixprec once (one thread, before any parallel region, so forking is
safe), then reads one script path a line from stdin and forks a child for it: the child
redirects its output to LOGDIR/<name>.log, puts the script's folder first on ``sys.path`` (in
place of the runner's own, as ``python PATH`` does) and runs the script with ``runpy`` as
``__main__``. A child that exceeds TIMEOUT_S is killed with its process group. One JSON line per
path goes to stdout when its child ends: {"path", "rc", "seconds", "log"}. Without ``os.fork``
each path runs in a fresh interpreter instead (slower, same result).

``ForkPool`` feeds its runners from one queue, in the order the scripts were submitted, and a
test waits for its own script's result only: no test waits for every script.

Markdown: a block whose first line is ``# doc: no-run (reason)`` is not run; the reason is
required.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import runpy
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Iterable
from typing import IO

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
    sys.path[0] = os.path.dirname(os.path.abspath(path))  # the runner's own folder is not seen
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


class ForkPool:
    """``workers`` runner processes (``python forked_runner.py LOGDIR TIMEOUT_S serve``) fed from
    one queue: ``submit`` scripts in the order they will be asked for, ``result`` waits for one.

    ``env`` is added to this process's environment (``OMP_NUM_THREADS=1`` by default); ``cwd`` is
    the runners' working directory. Results are by path: {"rc", "seconds", "log"}; a path whose
    runner died has {"rc": "runner died", "log": <the runner's stderr file>}.
    """

    def __init__(
        self, logdir: str, timeout: float, workers: int, env: dict[str, str], cwd: str
    ) -> None:
        self.timeout = timeout
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._results: dict[str, dict[str, object]] = {}
        self._submitted: set[str] = set()
        self._done = threading.Condition()
        argv = [sys.executable, os.path.abspath(__file__), logdir, str(timeout), "serve"]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
        self._procs: list[subprocess.Popen[str]] = []
        for k in range(workers):
            stderr = open(os.path.join(logdir, f"runner-{k}.stderr"), "w")  # noqa: SIM115
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                text=True, env=full_env, cwd=cwd,
            )  # fmt: skip
            self._procs.append(proc)
            thread = threading.Thread(target=self._feed, args=(proc, stderr.name), daemon=True)
            thread.start()

    def _feed(self, proc: subprocess.Popen[str], stderr: str) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        while (path := self._queue.get()) is not None:
            line = ""
            try:
                proc.stdin.write(path + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
            except (OSError, ValueError):  # the runner ended, or close() closed its pipes
                pass
            result = json.loads(line) if line else {"rc": "runner died", "log": stderr}
            with self._done:
                self._results[path] = {"seconds": 0.0, **result}
                self._done.notify_all()

    def submit(self, paths: Iterable[str]) -> None:
        for path in paths:
            self._submitted.add(path)
            self._queue.put(path)

    def result(self, path: str, *, again: bool = False) -> dict[str, object]:
        """The result of ``path``, submitted now if it was not (or ``again``)."""
        with self._done:
            if again:
                self._results.pop(path, None)
            if again or path not in self._submitted:
                self.submit([path])
            # Its own run, after at most one script ahead of it per runner, and the runners' start.
            wait = 2 * self.timeout + 60
            found = self._done.wait_for(lambda: path in self._results, wait)
            assert found, f"no result for {path} in {wait:.0f} s"
            return self._results[path]

    def close(self) -> None:
        """Drop what is still queued, end the runners (killed if they do not end at once)."""
        with self._queue.mutex:
            self._queue.queue.clear()
        for _ in self._procs:
            self._queue.put(None)
        for proc in self._procs:
            _end(proc)


def _end(proc: subprocess.Popen[str]) -> None:
    for stream in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):
            _close(stream)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _close(stream: IO[str] | None) -> None:
    if stream is not None:
        stream.close()


def main(argv: list[str]) -> int:
    logdir, timeout, mode = argv[0], float(argv[1]), argv[2]
    assert mode == "serve", f"usage: forked_runner.py LOGDIR TIMEOUT_S serve, not {mode!r}"
    forking = hasattr(os, "fork")
    if forking:
        import torch

        torch.set_num_threads(1)
        import mixprec  # noqa: F401  imported once, shared by every forked child
    for line in sys.stdin:
        path = line.rstrip("\n")
        log = os.path.join(logdir, os.path.basename(path) + ".log")
        start = time.monotonic()
        run = run_in_fork if forking else run_in_subprocess
        rc = run(path, "script", log, timeout)
        record = {"path": path, "rc": rc, "seconds": round(time.monotonic() - start, 2)}
        print(json.dumps({**record, "log": log}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
