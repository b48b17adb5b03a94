"""The low-precision all-gather under real FSDP2: gloo worlds of 1, 2 and 3 ranks on 127.0.0.1,
spawned here (tests/fsdp_gather_worker.py; the cache tests: tests/fsdp_cache_worker.py), every
recipe, each run against the same run without the gather. The workers only record; every
assertion is made here. Each world is bounded by a hard timeout and its processes are killed
in ``finally``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests import gloo_worlds
from torch import nn

from mixprec._src.fp8.carrier import pack_e2m1, unpack_e2m1
from mixprec._src.fp8.casts import quantize
from mixprec._src.fp8.gather import orientations
from mixprec._src.fp8.recipes import RECIPES, get_recipe
from mixprec.distributed import gather_low_precision
from mixprec.errors import ConfigError

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)

WORKER = Path(__file__).resolve().parents[1] / "fsdp_gather_worker.py"
CACHE_WORKER = WORKER.with_name("fsdp_cache_worker.py")
TIMEOUT_S = 90
ALL = ("tensorwise", "rowwise", "rowwise_gw_hp", "blockwise", "mxfp8", "nvfp4")


def run_world(
    outdir: Path,
    world: int,
    scenarios: list[str],
    worker: Path = WORKER,
    timeout: float = TIMEOUT_S,
) -> list[dict[str, Any]]:
    """:func:`tests.gloo_worlds.run_world` of this file's worker by default."""
    return gloo_worlds.run_world(outdir, world, scenarios, worker, timeout)


@pytest.fixture(scope="module")
def gather_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gather")


@pytest.fixture(scope="module")
def worlds(gather_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """A 2-rank world (parity, the unsharded run, optimizers, recomputation, the scaler, a
    checkpoint saved), then a 3-rank one (uneven shards, the checkpoint loaded there)."""
    two = run_world(
        gather_dir,
        2,
        [
            "parity",
            "unsharded",
            "optimizers",
            "one_group",
            "recompute",
            "scaler",
            "ckpt_save",
            "no_recompute",
            "per_matmul",
        ],
    )
    three = run_world(gather_dir, 3, ["uneven", "ckpt_load"])
    return {2: two, 3: three}


def _assert_bitwise(run: dict[str, Any]) -> None:
    plain, low = run["plain"], run["low"]
    for key in ("losses", "params"):
        for a, b in zip(plain[key], low[key], strict=True):
            assert torch.equal(a, b), key
    for step_a, step_b in zip(plain["grads"], low["grads"], strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            assert torch.equal(a, b), "grads"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ALL)
@pytest.mark.parametrize(("world", "scenario"), [(2, "parity"), (3, "uneven")])
def test_gather_is_bitwise_the_run_without_it(
    worlds: dict[int, list[dict[str, Any]]], world: int, scenario: str, recipe: str
) -> None:
    """2 ranks (384 rows: shards straddle the 128- and 32-row blocks), reshard_after_forward
    True; 3 ranks (256 rows: shards of 86, 86, 84), False, two micro-batches per step with
    set_requires_gradient_sync. A bf16 Linear sits beside the ruled ones."""
    for rank in worlds[world]:
        run = rank[scenario][recipe]
        _assert_bitwise(run)
        low = run["low"]
        assert low["names"] == ["0", "2"]  # the bf16 Linear "4" gathers as before
        forwards = len(low["losses"])
        gathers_per_forward = 2 if scenario == "parity" else 1  # backward re-gathers
        assert low["gathers"] == 2 * forwards * gathers_per_forward
        assert_scale_exchanges(run)


@pytest.fixture(scope="module")
def matrix(gather_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """The ``matrix`` and ``reshard_later`` scenarios in a world of one rank and one of two."""
    return {world: run_world(gather_dir, world, ["matrix", "reshard_later"]) for world in (1, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_every_world_recompute_and_reshard_is_bitwise_the_run_without_it(
    matrix: dict[int, list[dict[str, Any]]], world: int
) -> None:
    """World sizes 1 (FSDP2 skips the collective and copies the first all-gather input alone)
    and 2, recompute True/False, reshard_after_forward True/False, every family of the wire:
    with the gather, bit for bit the run without it; the codes were what the matmuls used (no
    recast, no high-precision gather), and the copies each gather carried travelled (both of a
    rowwise weight where it is recomputed or stays unsharded, one otherwise)."""
    runs = matrix[world][0]["matrix"]
    assert len(runs) == 5 * 2 * 2
    for rank in matrix[world]:
        for key, run in rank["matrix"].items():
            _assert_bitwise(run)
            low = run["low"]
            if world > 1:
                assert_scale_exchanges(run)
            else:  # FSDP2 calls no collective on one rank; the scales' exchange still runs
                assert run["plain"]["calls"] == [0] * len(low["grads"]), key
                assert low["calls"] == [1] * len(low["grads"]), key  # one forward a step
                assert low["collectives"] == len(low["losses"]), key
            family, recompute, reshard = key.split("/")
            rows = [384] * (2 if family in ALL else 1)  # the ruled weights' rows
            assert low["names"] == (["0", "2"] if family in ALL else ["2"]), key
            two = family in ("rowwise", "mxfp8", "fp4-fprop")
            both = two and (recompute == "recompute=True" or reshard == "reshard=False")
            per_value = (2 if both else 1) * (0.5 if family == "nvfp4" else 1)
            values = sum(-(-n // world) * 128 for n in rows)
            assert low["gather_bytes"] == low["gathers"] // len(rows) * values * per_value, key


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_reshard_after_forward_changed_after_the_first_gather(
    matrix: dict[int, list[dict[str, Any]]], world: int
) -> None:
    """FSDP2 sizes a weight's gather buffers at its first gather: set to reshard after the
    first (``set_reshard_after_forward(True)``), both copies keep travelling, bit for bit the
    run without the gather; set to keep the weights unsharded, refused by name, with the fix."""
    for rank in matrix[world]:
        run = rank["reshard_later"]["to_true"]
        _assert_bitwise(run)
        assert run["low"]["recasts"] == run["low"]["high_gathers"] == 0
        error = rank["reshard_later"]["to_false"]
        assert error is not None
        assert "set_reshard_after_forward" in error and "recompute=True" in error


@pytest.mark.slow
def test_resharding_to_fewer_ranks_after_forward_is_refused(tmp_path: Path) -> None:
    """``reshard_after_forward=2`` on 4 ranks: FSDP2 would keep a slice of the gathered codes as
    the parameter and gather it in backward past the extension; refused at set up, by name."""
    for rank in run_world(tmp_path, 4, ["reshard_int"]):
        error = rank["reshard_int"]["error"]
        assert error is not None and "reshard_after_forward=2" in error
        assert "Linear '0'" in error and "2 of 4 ranks" in error


@pytest.mark.slow
def test_rules_per_matmul_gather_the_weights_read_in_low_precision(
    worlds: dict[int, list[dict[str, Any]]],
) -> None:
    """'2=nvfp4/mxfp8/fp8' (and 'mxfp8/nvfp4/fp8') reads its weight as codes in fprop and
    dgrad, one copy fp4 and the other 8-bit: gathered so, each copy in its own format (the
    Linear runs dgrad, so both copies are used); '0=bf16/fp8/fp8' reads it in bf16 in fprop:
    FSDP's own gather, listed."""
    for rank in worlds[2]:
        for order, run in rank["per_matmul"].items():
            _assert_bitwise(run)
            low = run["low"]
            assert low["names"] == ["2"] and low["high_precision"] == ["0"], order
            assert_scale_exchanges(run)


def assert_scale_exchanges(run: dict[str, Any], per_forward: int = 1) -> None:
    """``per_forward`` scale collectives per forward (one where the region's outermost module
    call tells the forwards apart), and no other collective than the run without the gather
    calls (no high-precision gather either)."""
    low = run["low"]
    per_step = len(low["losses"]) // len(low["grads"])
    assert low["collectives"] == per_forward * len(low["losses"])
    assert extra_collectives(run) == [per_forward * per_step] * len(low["grads"])
    assert low["recasts"] == low["high_gathers"] == 0


def extra_collectives(run: dict[str, Any]) -> list[int]:
    """Per step, the torch.distributed collectives the run with the gather called beyond those
    of the run without it (counted by wrapping torch.distributed's functions in the worker)."""
    plain, low = run["plain"]["calls"], run["low"]["calls"]
    assert len(plain) == len(low) and min(plain) > 0  # FSDP2's own gathers were counted
    return [b - a for a, b in zip(plain, low, strict=True)]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ALL)
def test_two_ranks_are_bitwise_the_unsharded_run(
    worlds: dict[int, list[dict[str, Any]]], recipe: str
) -> None:
    """The parity scenario, with and without the gather, against one process running both
    ranks' batches through a bf16 copy of the fp32 model and averaging their fp32 gradients
    (what FSDP2 with a bf16 param_dtype and fp32 reduce_dtype computes; on 2 ranks the average
    is exact, on 3 the order of the reduction would show)."""
    for rank, result in enumerate(worlds[2]):
        unsharded = result["unsharded"][recipe]
        for run in (result["parity"][recipe]["plain"], result["parity"][recipe]["low"]):
            for a, b in zip(unsharded["losses"][rank], run["losses"], strict=True):
                assert torch.equal(a, b), "losses"
            for step_a, step_b in zip(unsharded["grads"], run["grads"], strict=True):
                for a, b in zip(step_a, step_b, strict=True):
                    assert torch.equal(a, b), "grads"
            for a, b in zip(unsharded["params"], run["params"], strict=True):
                assert torch.equal(a, b), "params"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ALL)
def test_scales_follow_foreach_and_fused_optimizers(
    worlds: dict[int, list[dict[str, Any]]], recipe: str
) -> None:
    """AdamW foreach and fused leave the sharded parameters' version counters as they were:
    the scales are recomputed at every forward's gather all the same."""
    for rank in worlds[2]:
        run = rank["optimizers"][recipe]
        _assert_bitwise(run)
        assert len(run["low"]["grads"]) == 3
        assert_scale_exchanges(run)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8", "nvfp4"])
def test_one_fsdp_group_mixing_codes_and_bf16_parameters(
    worlds: dict[int, list[dict[str, Any]]], recipe: str
) -> None:
    """The root alone sharded: one all-gather carries the ruled weights' codes (uint8) beside
    the biases and the bf16 Linear's weight (FSDP2 gathers mixed dtypes as bytes)."""
    for rank in worlds[2]:
        run = rank["one_group"][recipe]
        _assert_bitwise(run)
        assert run["low"]["names"] == ["0", "2"]
        assert_scale_exchanges(run)


def _bytes_per_value(run: dict[str, Any], rows: int, world: int) -> float:
    low = run["low"]
    values = -(-rows // world) * 128 * 2  # the two ruled weights' padded shards
    return low["gather_bytes"] / low["gathers"] / (values / 2)


@pytest.mark.slow
def test_only_the_phases_copy_travels(worlds: dict[int, list[dict[str, Any]]]) -> None:
    """One byte a value per gather (one orientation at a time, even for rowwise), NVFP4's half
    a byte where the rows divide evenly; both copies where the weight stays unsharded."""
    two, three = worlds[2][0], worlds[3][0]
    for recipe in ALL:
        want = 0.5 if recipe == "nvfp4" else 1.0
        assert _bytes_per_value(two["parity"][recipe], 384, 2) == want
        both = 2.0 if len(orientations(get_recipe(recipe))) == 2 else 1.0
        assert _bytes_per_value(three["uneven"][recipe], 256, 3) == both  # nvfp4 unpacked
    assert _bytes_per_value(two["recompute"]["rowwise"], 384, 2) == 2.0


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rowwise", "nvfp4"])
def test_activation_checkpointing(worlds: dict[int, list[dict[str, Any]]], recipe: str) -> None:
    for rank in worlds[2]:
        _assert_bitwise(rank["recompute"][recipe])


@pytest.mark.slow
def test_recomputation_without_recompute_is_refused(
    worlds: dict[int, list[dict[str, Any]]],
) -> None:
    for rank in worlds[2]:
        error = rank["no_recompute"]["error"]
        assert error is not None and "recompute=True" in error
        assert "of Linear '0'" in error or "of Linear '2'" in error


@pytest.mark.slow
def test_scaler_skips_together_and_stats_count_the_bytes(
    worlds: dict[int, list[dict[str, Any]]],
) -> None:
    """fp16 + GradScaler, an inf on rank 1 at step 1: both ranks skip it, with the gather as
    without."""
    for rank in worlds[2]:
        run = rank["scaler"]["mxfp8"]
        _assert_bitwise(run)
        assert run["plain"]["skipped"] == run["low"]["skipped"] == [False, True, False]
        assert_scale_exchanges(run)
        forward_bytes = 3 * 192 * 128  # three forwards (the stats' context) of 192 x 128 codes
        assert run["low"]["stats_gathered"] == {"0": forward_bytes, "2": forward_bytes}
        assert run["plain"]["stats_gathered"] == {"0": 0, "2": 0}


@pytest.mark.slow
def test_compiled_sharded_model(tmp_path: Path) -> None:
    """``torch.compile`` (inductor) of the FSDP2 model, every recipe family (square blocks,
    two orientations, NVFP4's packed codes): with the gather, bit for bit the compiled run
    without it and the eager run; Dynamo captured graphs (the gathered weight's matmuls run
    between them)."""
    (result, *others) = run_world(tmp_path, 2, ["compiled"], timeout=3 * TIMEOUT_S)
    for rank in (result, *others):
        for run in rank["compiled"].values():
            _assert_bitwise({"plain": run["eager"], "low": run["plain"]})
            _assert_bitwise(run)
            assert_scale_exchanges(run)
    assert result["compiled"]["tensorwise"]["low"]["graphs"] > 0


@pytest.mark.slow
def test_checkpoint_is_plain_and_loads_at_another_world_size(
    worlds: dict[int, list[dict[str, Any]]],
) -> None:
    saved = worlds[2][0]["ckpt_save"]
    assert saved["local_types"] == ["Tensor"] and saved["attributes"] == []
    assert saved["pickled"]
    for rank in worlds[3]:
        loaded = rank["ckpt_load"]
        assert loaded.keys() >= {"params", "loss"}
        for name, value in saved["params"].items():
            assert torch.equal(value, loaded["params"][name]), name
            assert torch.equal(value, loaded["plain_params"][name]), name  # FSDP2 alone
        assert torch.isfinite(loaded["loss"][0])
        for a, b in zip(loaded["loss"], loaded["plain_loss"], strict=True):
            assert torch.equal(a, b)  # loss and grads on 3 ranks: the gather changes nothing
        assert loaded["collectives"] == 1  # one forward


MIXPREC_FREE = """
import sys
sys.modules["mixprec"] = None  # any import of mixprec now raises
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp, out = sys.argv[1], sys.argv[2]
dcp_to_torch_save(dcp, out)
full = torch.load(out, weights_only=True)
shards = [torch.load(f, weights_only=True) for f in sys.argv[3:]]
torch.save({"full": full, "shards": shards}, out)
"""


@pytest.mark.slow
def test_checkpoints_load_where_mixprec_cannot_import(
    worlds: dict[int, list[dict[str, Any]]], gather_dir: Path
) -> None:
    """The run with the gather saved a DCP checkpoint and each rank's local shards with
    ``torch.save``: a process in which mixprec cannot be imported reads both with
    ``weights_only=True`` (no mixprec type, no attribute of the gather inside), and they hold
    the trained weights."""
    saved = worlds[2][0]["ckpt_save"]["params"]
    out = gather_dir / "mixprec-free.pt"
    shards = [str(gather_dir / f"local-{r}.pt") for r in range(2)]
    cmd = [sys.executable, "-c", MIXPREC_FREE, str(gather_dir / "dcp"), str(out), *shards]
    subprocess.run(cmd, check=True, timeout=TIMEOUT_S, capture_output=True)
    loaded = torch.load(out, weights_only=True)
    assert loaded["full"]["model"].keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(loaded["full"]["model"][name], value), name
        rows = [shard[name] for shard in loaded["shards"]]
        assert all(type(t) is torch.Tensor for t in rows)
        assert torch.equal(torch.cat(rows)[: value.shape[0]], value), name  # FSDP2's chunks


# ---------------------------------------------------------------------- one process


@pytest.mark.parametrize("recipe", ["nvfp4"])
def test_e2m1_packing_round_trips(recipe: str) -> None:
    torch.manual_seed(0)
    q, _ = quantize(torch.randn(32, 64), get_recipe(recipe).w, 1)  # type: ignore[arg-type]
    packed = pack_e2m1(q.codes)
    assert packed.dtype == torch.uint8 and packed.shape == (32, 32)
    back = unpack_e2m1(packed)
    assert torch.equal(back.view(torch.uint8), q.codes.view(torch.uint8))  # -0 kept too


def test_orientations_of_every_recipe() -> None:
    """One copy where the weight's two casts are the same square blocks."""
    single = {n for n, r in RECIPES.items() if len(orientations(r)) == 1}
    assert single == {"tensorwise", "blockwise", "nvfp4"}


def test_refuses_a_model_that_is_not_sharded() -> None:
    import mixprec

    with pytest.raises(ConfigError, match="fully_shard"):
        gather_low_precision(nn.Linear(4, 4), mixprec.Policy("nn.Linear=fp8"))


# ---------------------------------------------------------------------- the cache, never a value


@pytest.fixture(scope="module")
def cache_world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 2-rank world: the parameters changed in place every way between steps, each forward
    entered two ways; the weight read by other readers than its rule's matmul and run under
    other rules than the gather's; a Linear with fewer rows than ranks."""
    outdir = tmp_path_factory.mktemp("cache")
    return run_world(outdir, 2, ["refresh", "readers", "few_rows"], CACHE_WORKER)


@pytest.mark.slow
def test_gathered_codes_are_a_fresh_cast_after_every_change(
    cache_world: list[dict[str, Any]],
) -> None:
    """Whatever changed the parameters in place since the last step (SGD, AdamW foreach and
    fused, ``torch._foreach_add_``/``_foreach_mul_`` by hand, ``copy_``, ``.data``, an in-place
    ``torch.distributed.checkpoint`` load) and however the forward is entered (a call, a method
    FSDP2's ``register_fsdp_forward_method`` wraps): bit for bit the run without the gather,
    with no high-precision fallback (the codes were fresh, so the matmuls used them)."""
    variants = cache_world[0]["refresh"]
    assert len(variants) == 16
    for rank in cache_world:
        for key, run in rank["refresh"].items():
            _assert_bitwise(run)
            assert run["low"]["recasts"] == run["low"]["high_gathers"] == 0, key
            assert run["low"]["gathers"] > 0, key  # the codes were gathered and used
            # a method FSDP2 wraps calls the two Linears as two outermost module calls
            assert_scale_exchanges(run, 2 if "/method/" in key else 1)


@pytest.mark.slow
def test_other_readers_get_the_weights_own_values(cache_world: list[dict[str, Any]]) -> None:
    """A LoRA merge ``W + B @ A``, ``x @ W.t()``, an op on the weight beside the matmul, an
    Embedding tied to a ruled head: bit for bit the run without the gather (the weight's own
    values, all-gathered for them, never a dequantized copy), and after the step the handle
    holds the own values of one weight at most (they are dropped at the next gather)."""
    for rank in cache_world:
        for key in ("lora", "t_matmul", "norm", "tied"):
            run = rank["readers"][key]
            _assert_bitwise(run)
            forwards = len(run["low"]["losses"])
            assert run["low"]["high_gathers"] >= forwards, key  # at least one per forward
            assert run["low"]["recasts"] == 0, key
            assert max(run["low"]["kept"]) <= 1, key  # one weight's own values held at most


@pytest.mark.slow
def test_a_forward_under_another_rule_does_not_use_the_gathered_codes(
    cache_world: list[dict[str, Any]],
) -> None:
    """The gather set up for mxfp8, the second step run under another policy (a Schedule's
    later phase): nvfp4, tensorwise fp8 for one Linear, bf16 for one. Bit for bit the run
    without the gather (which casts the weight for the rule it runs); the matmuls whose rule
    wants another cast are counted, and read the weight's own values."""
    for rank in cache_world:
        for later, recasts in (("nvfp4", 2), ("fp8", 1), ("bf16", 0)):
            run = rank["readers"][f"then_{later}"]
            _assert_bitwise(run)
            assert run["low"]["recasts"] >= recasts, later  # forward (and dgrad) matmuls
            assert (run["low"]["recasts"] > 0) == (later != "bf16"), later
            assert run["low"]["high_gathers"] >= 1, later


@pytest.mark.slow
def test_the_gather_asks_the_forwards_resolver(cache_world: list[dict[str, Any]]) -> None:
    """One Linear registered as ``a`` and ``b``, ruled by its second name over a class rule, in
    both recipe orders: the gather gathers it in the recipe the forward runs it in (its stats
    say which), so no matmul recasts, bit for bit the run without the gather."""
    for rank in cache_world:
        for first, second in (("mxfp8", "nvfp4"), ("nvfp4", "mxfp8")):
            run = rank["readers"][f"shared_{first}_{second}"]
            _assert_bitwise(run)
            low = run["low"]
            ran = {name: r for name, r in low["stats_recipes"].items() if name in ("a", "b")}
            assert len(ran) == 1 and set(ran.values()) == {second}, (ran, low)
            assert low["recipes"] == {**ran, "c": first}, (ran, low)
            assert low["recasts"] == low["high_gathers"] == 0


@pytest.mark.slow
def test_a_linear_with_fewer_rows_than_ranks(cache_world: list[dict[str, Any]]) -> None:
    """``Linear(128, 1)`` on 2 ranks (rank 1 holds none of its rows), tensorwise and rowwise."""
    for rank in cache_world:
        for recipe, run in rank["few_rows"].items():
            _assert_bitwise(run)
            assert run["low"]["names"] == ["0", "2"], recipe
            assert_scale_exchanges(run)
