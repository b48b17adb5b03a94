"""Every rank agrees: 2-process gloo worlds on 127.0.0.1, spawned here (tests/dist_worker.py).

Each world runs several scenarios to keep the start-up cost (a few seconds per world) low; the
workers only record, and every assertion is made here. Every world is bounded by a hard timeout
and its processes are killed in ``finally``, also when a test fails.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tests import gloo_worlds

import mixprec
from mixprec.errors import ConfigError

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)

WORKER = Path(__file__).resolve().parents[1] / "dist_worker.py"
WORLD = 2
TIMEOUT_S = 60
SPAWNED = ["ddp", "fsdp2", "fsdp2_fp16_policy", "fused", "fsdp1", "join", "clip", "ckpt_save"]


def run_world(outdir: Path, scenarios: list[str]) -> list[dict[str, Any]]:
    """Run ``scenarios`` in one fresh 2-rank world; per scenario, both ranks' results."""
    return gloo_worlds.run_world(outdir, WORLD, scenarios, WORKER, TIMEOUT_S)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One world for every training scenario (DDP, FSDP2, FSDP1, fused, Join, checkpoint)."""
    outdir = tmp_path_factory.mktemp("world")
    return outdir, run_world(outdir, SPAWNED)


@pytest.fixture
def world(spawned: tuple[Path, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return spawned[1]


def _assert_agree(results: list[dict[str, Any]]) -> None:
    first = results[0]
    for other in results[1:]:
        assert other["scales"] == first["scales"]
        assert other["skipped"] == first["skipped"]
        assert other["state"] == first["state"]
        assert other["collectives"] == first["collectives"]


def _params_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["ddp", "fsdp2"])
def test_inf_on_one_rank_skips_everywhere_like_single_process(world: list, scenario: str) -> None:
    ranks = [w[scenario] for w in world]
    _assert_agree(ranks)
    reference = ranks[0]["reference"]  # one process, full batch, torch.amp.GradScaler("cpu")
    assert ranks[0]["scales"] == reference["scales"]
    assert ranks[0]["skipped"] == reference["skipped"]
    assert sum(reference["skipped"]) == 2
    for rank in ranks:
        _params_close(rank["params"], reference["params"])
    assert ranks[0]["collectives"] == len(ranks[0]["scales"])  # one all-reduce per iteration


@pytest.mark.slow
def test_distributed_clip_matches_torch_norm_of_dtensor_grads(world: list) -> None:
    for rank in world:
        norms = rank["fsdp2"]["norms"]
        for p in (2.0, math.inf):
            assert norms[f"mixprec_{p}"] == pytest.approx(norms[f"torch_{p}"], rel=1e-5)
            assert norms[f"after_{p}"] == pytest.approx(1.0, rel=1e-4)
            assert norms[f"scaler_{p}"] == pytest.approx(norms[f"torch_{p}"], rel=1e-5)
    assert world[0]["fsdp2"]["norms"] == world[1]["fsdp2"]["norms"]


@pytest.mark.slow
def test_scaler_clip_uses_the_global_norm_and_agrees(world: list) -> None:
    """scaler.clip_grad_norm_/clip_grad_value_ (fused unscale+clip) with a process group."""
    ranks = [w["clip"] for w in world]
    for rank in ranks:
        norms, oracle = rank["norms"], rank["oracle"]  # p=2, p=inf, p=2 with an inf on rank 0
        assert norms[:2] == pytest.approx(oracle[:2], rel=1e-5)
        assert math.isinf(norms[2]) and math.isinf(oracle[2])
        clean = [rank["clipped_ok"][i] for i in (0, 1, 4)]  # norm, norm, value clipping
        assert clean == [True, True, True]
        assert rank["skipped"] == [False, False, True, True, False]
    assert ranks[0]["norms"][:2] == ranks[1]["norms"][:2]
    assert ranks[0]["state"] == ranks[1]["state"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["plain", "unscale"])
def test_fused_adam_inf_on_rank0_only(world: list, variant: str) -> None:
    """torch's ShardedGradScaler: rank 0 skips, rank 1 steps (plain); crash (explicit unscale_)."""
    ranks = [w["fused"][variant] for w in world]
    _assert_agree(ranks)
    assert [i for i, s in enumerate(ranks[0]["skipped"]) if s] == [1, 4]
    assert ranks[0]["collectives"] == len(ranks[0]["scales"])


@pytest.mark.slow
def test_fsdp2_fp16_policy_and_fsdp1_low_precision_grads(world: list) -> None:
    fsdp2 = [w["fsdp2_fp16_policy"] for w in world]
    _assert_agree(fsdp2)
    assert [i for i, s in enumerate(fsdp2[0]["skipped"]) if s] == [3]
    fsdp1 = [w["fsdp1"] for w in world]
    _assert_agree(fsdp1)
    for ranks in (fsdp2, fsdp1):  # one all-reduce per iteration, also with unscale_ + fused
        assert ranks[0]["collectives"] == len(ranks[0]["scales"])
    assert fsdp1[0]["grad_dtypes"] == ["torch.float16"]  # accepted: their params are fp32
    assert [i for i, s in enumerate(fsdp1[0]["skipped"]) if s] == [2]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["plain", "clip"])
def test_join_keeps_scale_and_counters_equal_with_uneven_inputs(world: list, variant: str) -> None:
    """Rank 0 has 3 batches, rank 1 has 8; with scaler.clip_grad_norm_ in the ``clip`` variant."""
    short, long = (w["join"][variant] for w in world)
    assert len(short["scales"]) == 3 and len(long["scales"]) == 8
    assert long["skipped"][5]  # after rank 0 joined: its shadow iteration backs off too
    assert short["state"] == long["state"]
    assert short["history_len"] == long["history_len"] == 8
    assert (short["steps_taken"], short["steps_skipped"]) == (7, 1)
    for rank in (short, long):  # DDP's grads are replicated: the clipping norm stays local
        pairs = list(zip(rank["norms"][::2], rank["norms"][1::2], strict=True))
        assert len(pairs) == (len(rank["scales"]) if variant == "clip" else 0)
        for torch_norm, norm in pairs:
            assert norm == pytest.approx(torch_norm, rel=1e-5) or math.isinf(torch_norm)


@pytest.mark.slow
def test_checkpoint_saved_on_two_ranks_resumes_identically(spawned: tuple) -> None:
    """The checkpoint written at iteration 4 of ``ckpt_save``, resumed in a fresh world."""
    outdir, saved = spawned
    resumed = run_world(outdir, ["ckpt_resume"])
    for before, after in zip(saved, resumed, strict=True):
        b, a = before["ckpt_save"], after["ckpt_resume"]
        assert a["scales"] == b["scales"] and a["skipped"] == b["skipped"]
        assert a["state"] == b["state"]
        for x, y in zip(a["params"], b["params"], strict=True):
            assert torch.equal(x, y)
    assert saved[0]["ckpt_save"]["skipped"][1]  # iteration 5 (inf on rank 1) was skipped
    assert resumed[0]["ckpt_resume"]["pickled"] == (None, True)  # the group is not pickled


def test_process_group_is_validated_and_not_saved() -> None:
    with pytest.raises(ConfigError, match="process_group"):
        mixprec.GradScaler(process_group="world")
    with pytest.raises(ConfigError, match="process_group"):
        mixprec.GradScaler(3.0, process_group=1)  # the seed form takes it too
    scaler = mixprec.GradScaler()
    with pytest.raises(ConfigError, match="process_group"):
        scaler.process_group = "world"
    assert "process_group" not in scaler.state_dict()


def test_misuse_is_refused_before_any_collective() -> None:
    with pytest.raises(ConfigError, match=r"0-d tensor \(shape \(\)\)"):
        mixprec.distributed.agree_found_inf_(torch.zeros(1))  # ShardedGradScaler's (1,) shape
    with pytest.raises(ConfigError, match=r"init_process_group"):
        mixprec.JoinableScaler(mixprec.GradScaler())
