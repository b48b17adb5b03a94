"""torchtitan 0.3's llama3 debug model converted by mixprec's ``MixprecConverter``, with and
without the low-precision gather, on 2 gloo ranks: bit for bit the same.

* torchtitan's own trainer (``torchtitan.train.main``: its data loader, fused AdamW, warm-up
  schedule, gradient clipping, selective activation checkpointing, FSDP2 set-up), run by
  ``tests/torchtitan_trainer.py`` under ``torch.distributed.run`` with the CPU stand-ins it
  lists (docs/torchtitan.md says why each is needed).
* A plain FSDP2 loop over torchtitan's model definitions (``tests/torchtitan_worker.py``).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed: the Makefile installs it (constraints.txt) in .venv "
    "only, not in the venvs of the other torch versions",
)

TESTS = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240


def write_assets(root: Path) -> None:
    """What the debug config reads from ``./tests/assets`` of torchtitan's repository (which its
    wheel does not ship), made as the CPU example makes them (examples/torchtitan_llama3.py)."""
    from tests.torchtitan_trainer import example

    example.write_assets(root)


def run_trainer(root: Path, gather: bool) -> str:
    """``torch.distributed.run`` of tests/torchtitan_trainer.py on 2 ranks in ``root``: 3 steps
    of 2 sequences of 64 tokens per rank, seeded; its output, or a failure with it."""
    args = ["--module", "torchtitan_trainer", "--config", "llama3_debugmodel_mixprec"]
    args += ["--training.steps", "3", "--training.seq-len", "64"]
    args += ["--training.local-batch-size", "2", "--debug.seed", "0"]
    # the default ("full_dtensor") refuses FSDP2's plain parameters on torch 2.13
    args += ["--parallelism.spmd-backend", "partial_dtensor"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    paths = [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "MIXPREC_TITAN_OUT": str(root / "titan"),
        "MIXPREC_TITAN_GATHER": "1" if gather else "0",
        "HF_HOME": str(root / "hf"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    log = root / f"log-{int(gather)}.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*launch, "2", str(TESTS / "torchtitan_trainer.py"), *args],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, f"exit {proc.returncode} (timeout {TIMEOUT_S} s):\n{text[-6000:]}"
    return text


@pytest.mark.slow
def test_torchtitan_trainer_with_the_converter_and_the_gather(tmp_path: Path) -> None:
    write_assets(tmp_path)
    for gather in (False, True):
        assert "Training completed" in run_trainer(tmp_path, gather)
    for rank in range(2):
        plain = torch.load(tmp_path / f"titan0-{rank}.pt", weights_only=False)
        low = torch.load(tmp_path / f"titan1-{rank}.pt", weights_only=False)
        assert plain["class"] == low["class"] == "FSDPMixprecLlama3Model"
        assert plain["gathered"] == [] and plain["collectives"] == 0
        # the six blocks' five Linears (wqkv, wo, w1, w2, w3); lm_head is kept in bf16
        assert len(low["gathered"]) == 30 and not any("lm_head" in n for n in low["gathered"])
        assert len(low["losses"]) == low["collectives"] == 3  # one scale exchange per step
        for a, b in zip(plain["losses"], low["losses"], strict=True):
            assert torch.equal(a, b)
        assert plain["params"].keys() == low["params"].keys()
        for name, value in plain["params"].items():
            assert torch.equal(value, low["params"][name]), name
        assert len({float(v) for v in low["losses"]}) == 3  # it trained: each step differs


@pytest.mark.slow
def test_torchtitan_models_in_a_plain_fsdp2_loop(tmp_path: Path) -> None:
    from tests.fp8.test_fsdp_gather import run_world

    ranks = run_world(tmp_path, 2, [], TESTS / "torchtitan_worker.py")
    for rank in range(2):
        result = torch.load(tmp_path / f"titan-{rank}.pt", weights_only=False)
        plain, low = result["plain"], result["low"]
        assert low["class"] == "FSDPMixprecLlama3Model"
        assert plain["gathered"] == [] and plain["collectives"] == 0
        assert "lm_head" not in low["gathered"] and len(low["gathered"]) == 10  # 5 per block
        assert low["collectives"] == len(low["losses"])
        for a, b in zip(plain["losses"], low["losses"], strict=True):
            assert torch.equal(a, b)
        for name, value in plain["params"].items():
            assert torch.equal(value, low["params"][name]), name
    assert ranks == [{}, {}]
