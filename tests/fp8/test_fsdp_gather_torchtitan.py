"""torchtitan's llama3 debug model built through mixprec's model converter, sharded by FSDP2 on 2
gloo ranks (tests/torchtitan_worker.py), trained in a plain loop with and without the
low-precision gather: bit for bit the same. torchtitan's own trainer cannot run on a CPU-only
machine (docs/torchtitan.md says why), so the loop is ours and the model is theirs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None or importlib.util.find_spec("triton") is None,
    reason="torchtitan >= 0.3 (and triton, which it imports) is not installed in this environment",
)


@pytest.mark.slow
def test_torchtitan_converter_with_the_gather(tmp_path: Path) -> None:
    from tests.fp8.test_fsdp_gather import run_world

    ranks = run_world(
        tmp_path, 2, [], (Path(__file__).resolve().parents[1] / "torchtitan_worker.py")
    )
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
