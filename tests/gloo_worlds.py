"""Worlds of gloo ranks on 127.0.0.1, spawned by the tests: one process per rank, each running a
worker script (``tests/*_worker.py``: ``WORKER RANK WORLD PORT_FILE OUTDIR [SCENARIO ...]``, set up
and torn down by ``dist_worker.run_rank``). Every world is bounded by a hard timeout and its
processes are killed in ``finally``, also when a test fails; the workers only record, and the
tests do all the asserting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch


def run_world(
    outdir: Path, world: int, scenarios: list[str], worker: Path, timeout: float = 90
) -> list[dict[str, Any]]:
    """Run ``scenarios`` in one fresh ``world``-rank world of ``worker`` (within ``timeout``
    seconds); per rank, each scenario's result (``OUTDIR/<scenario>-<rank>.pt``)."""
    world_id = uuid.uuid4().hex[:8]
    port_file = outdir / f"port-{world_id}.txt"  # rank 0 binds a free port and writes it here
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if sys.platform.startswith("linux"):  # gloo on the loopback, whatever the hostname resolves to
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs, logs = [], []
    try:
        for rank in range(world):
            log = open(outdir / f"log-{rank}-{world_id}.txt", "w")  # noqa: SIM115 (closed below)
            logs.append(log)
            args = [sys.executable, str(worker), str(rank), str(world), str(port_file)]
            procs.append(
                subprocess.Popen(
                    [*args, str(outdir), *scenarios],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {world}-rank world did not finish within {timeout} s: {tails(outdir)}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in logs:
            log.close()
    codes = [proc.returncode for proc in procs]
    assert codes == [0] * world, f"worker exit codes {codes}: {tails(outdir)}"
    return [
        {name: torch.load(outdir / f"{name}-{r}.pt", weights_only=False) for name in scenarios}
        for r in range(world)
    ]


def tails(outdir: Path) -> str:
    """The end of every rank's log in ``outdir``."""
    return "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(outdir.glob("log-*.txt"))
    )
