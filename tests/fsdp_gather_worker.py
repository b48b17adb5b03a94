"""One rank of the gloo worlds that tests/fp8/test_fsdp_gather.py spawns: FSDP2 with and without the
low-precision all-gather, every recipe.

Usage: ``python fsdp_gather_worker.py RANK WORLD_SIZE PORT_FILE OUTDIR SCENARIO [SCENARIO ...]``.
Each scenario writes ``OUTDIR/<scenario>-<rank>.pt``; the test does all the asserting.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mixprec
from dist_worker import run_rank, scenarios_of
from mixprec.distributed import gather_low_precision

RECIPES = ("tensorwise", "rowwise", "rowwise_gw_hp", "blockwise", "mxfp8", "nvfp4")
WORDS = {"tensorwise": "fp8", "blockwise": "fp8:blockwise", "mxfp8": "mxfp8", "nvfp4": "nvfp4"}
STEPS = 2
# AdamW's implementations: the CPU's default loops over the tensors; CUDA's default (foreach)
# and the fused one update the sharded parameters without bumping their version counters.
OPTIMIZERS: dict[str, dict[str, bool]] = {
    "single": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}
OUTDIR = Path(".")


def word(recipe: str) -> str:
    return WORDS.get(recipe, f"fp8:{recipe}")


def make_model(rows: int) -> nn.Sequential:
    """Two ruled Linears whose out_features do not divide into the ranks' or the blocks'
    rows evenly, and one Linear left in bf16 (a mixed model)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(128, rows), nn.GELU(), nn.Linear(rows, 128), nn.GELU(), nn.Linear(128, 16)
    )


#: Rules per matmul, in both orders of the weight's two formats: "2" (which runs dgrad) reads its
#: weight in low precision in fprop and dgrad, fp4 in one and 8-bit in the other (gathered as
#: codes, each copy in its own format); "0" reads it in bf16 in fprop (gathered by FSDP).
PER_MATMUL = {
    "fp4-fprop": {"0": "bf16/fp8/fp8", "2": "nvfp4/mxfp8/fp8", "4": "bf16"},
    "fp4-dgrad": {"0": "bf16/fp8/fp8", "2": "mxfp8/nvfp4/fp8", "4": "bf16"},
}


def policy_for(recipe: str) -> mixprec.Policy:
    if recipe in PER_MATMUL:
        return mixprec.Policy(modules=PER_MATMUL[recipe])
    return mixprec.Policy(modules={"0": word(recipe), "2": word(recipe), "4": "bf16"})


def shard(
    model: nn.Module, reshard: bool, dtype: torch.dtype = torch.bfloat16, one_group: bool = False
) -> nn.Module:
    """Each Linear its own FSDP2 group, then the root; or (``one_group``) the root alone: one
    group holding the ruled Linears' weights, their biases and the bf16 Linear."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for i in () if one_group else (0, 2, 4):
        fully_shard(model[i], mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
    return model


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(32, 128, generator=gen), torch.randn(32, 16, generator=gen)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(
    recipe: str,
    low: bool,
    *,
    rows: int = 384,
    reshard: bool = True,
    accumulate: int = 1,
    checkpoint: bool = False,
    steps: int = STEPS,
    compiled: bool = False,
    scaler: bool = False,
    optim: str = "single",
    one_group: bool = False,
    reshard_later: bool | None = None,
) -> dict[str, Any]:
    """Train the sharded model a few steps; losses, gradients and parameters of every step, and
    the torch.distributed collectives each step called. With ``scaler``: fp16 parameters and
    autocast, a GradScaler, an inf on rank 1 at step 1. With ``reshard_later``: FSDP2's
    ``set_reshard_after_forward(reshard_later)`` before step 1."""
    dtype = torch.float16 if scaler else torch.bfloat16
    model = shard(make_model(rows), reshard, dtype, one_group)
    policy = policy_for(recipe)
    handle = gather_low_precision(model, policy, recompute=checkpoint) if low else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **OPTIMIZERS[optim])
    grad_scaler = mixprec.GradScaler("cpu", init_scale=2.0**10) if scaler else None
    stats = mixprec.Fp8Stats()
    run = torch.compile(model) if compiled else model
    log: dict[str, Any] = {"losses": [], "grads": [], "skipped": [], "calls": []}
    with counting(log["calls"]):
        for step in range(steps):
            log["calls"].append(0)
            if step == 1 and reshard_later is not None:
                model.set_reshard_after_forward(reshard_later)
            for micro in range(accumulate):
                if accumulate > 1:
                    model.set_requires_gradient_sync(micro == accumulate - 1)
                x, y = batch(dist.get_rank(), step, micro)
                with stats, mixprec.autocast("cpu", dtype, policy=policy):
                    out = forward(run, x, checkpoint)
                loss = (out.float() - y).square().mean()
                (loss if grad_scaler is None else grad_scaler.scale(loss)).backward()
                log["losses"].append(loss.detach())
            optimizer_step(model, opt, grad_scaler, step, log)
    log["params"] = [full(p) for p in model.parameters()]
    log["stats_gathered"] = {k: v.gathered_bytes for k, v in stats.read().items()}
    return {**log, **(counts(handle) if handle is not None else {})}


def optimizer_step(
    model: nn.Module, opt: Any, grad_scaler: Any, step: int, log: dict[str, Any]
) -> None:
    if grad_scaler is not None and step == 1 and dist.get_rank() == 1:
        model[0].weight.grad.to_local().view(-1)[0] = float("inf")
    log["grads"].append([full(p.grad) for p in model.parameters()])
    if grad_scaler is None:
        opt.step()
    else:
        grad_scaler.step(opt)
        grad_scaler.update()
        log["skipped"].append(grad_scaler.last_step_skipped())
    opt.zero_grad()


def counts(handle: Any) -> dict[str, Any]:
    """What the gather's handle counted (the test checks them against ``calls``)."""
    names = (
        "collectives",
        "gathers",
        "gather_bytes",
        "scale_bytes",
        "names",
        "high_precision",
        "recipes",
        "recasts",
        "high_gathers",
    )
    return {name: getattr(handle, name) for name in names}


COUNTED = (
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
    "all_to_all_single",
)


@contextmanager
def counting(calls: list[int]) -> Iterator[None]:
    """Count every call of torch.distributed's collectives into ``calls[-1]`` (FSDP2's own
    all-gathers and reduce-scatters, the gather's scale exchange), independently of the
    gather's own counters."""
    saved = {name: getattr(dist, name) for name in COUNTED if hasattr(dist, name)}

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[-1] += 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in saved.items():
        setattr(dist, name, wrap(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def train_unsharded(recipe: str, world: int, steps: int = STEPS) -> dict[str, Any]:
    """The parity scenario's run in one process: the fp32 model; each rank's batch through a
    bf16 copy of it (FSDP2's ``param_dtype`` and input cast) with that rank's random stream
    (NVFP4 rounds gradients stochastically); the ranks' gradients in fp32, averaged (FSDP2's
    ``reduce_dtype``); the same AdamW on the fp32 parameters."""
    import copy

    master = make_model(384)
    streams = [torch.get_rng_state() for _ in range(world)]  # each rank's, after make_model
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, **OPTIMIZERS["single"])
    policy = policy_for(recipe)
    losses: list[list[torch.Tensor]] = [[] for _ in range(world)]
    grads = []
    for step in range(steps):
        total = [torch.zeros_like(p) for p in master.parameters()]
        for rank in range(world):
            replica = copy.deepcopy(master).to(torch.bfloat16)
            x, y = batch(rank, step)
            torch.set_rng_state(streams[rank])
            with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
                out = replica(x.to(torch.bfloat16))
            loss = (out.float() - y).square().mean()
            loss.backward()
            streams[rank] = torch.get_rng_state()
            losses[rank].append(loss.detach())
            for t, p in zip(total, replica.parameters(), strict=True):
                t += p.grad.float()
        for p, t in zip(master.parameters(), total, strict=True):
            p.grad = t / world
        grads.append([p.grad.clone() for p in master.parameters()])
        opt.step()
        opt.zero_grad()
    params = [p.detach().clone() for p in master.parameters()]
    return {"losses": losses, "grads": grads, "params": params}


def forward(model: nn.Module, x: torch.Tensor, checkpoint: bool) -> torch.Tensor:
    if not checkpoint:
        return model(x)
    from torch.utils.checkpoint import checkpoint as ckpt

    return ckpt(model, x, use_reentrant=False)


# ---------------------------------------------------------------------- scenarios


def scenario_parity(rank: int) -> dict[str, Any]:
    """Every recipe, with and without the gather (reshard_after_forward=True)."""
    return {r: {"plain": train(r, False), "low": train(r, True)} for r in RECIPES}


def scenario_per_matmul(rank: int) -> dict[str, Any]:
    """Rules per matmul: the Linear whose fprop and dgrad read the weight in low precision is
    gathered as codes, the one whose fprop is bf16 as FSDP gathers it; bitwise either way."""
    return {k: {"plain": train(k, False), "low": train(k, True)} for k in PER_MATMUL}


def scenario_unsharded(rank: int) -> dict[str, Any]:
    """Every recipe: the parity scenario's run without FSDP2 (2 ranks' batches in one process)."""
    return {r: train_unsharded(r, dist.get_world_size()) for r in RECIPES}


def scenario_uneven(rank: int) -> dict[str, Any]:
    """Every recipe at world size 3 (256 rows: shards of 86, 86 and 84), the weights kept
    unsharded from forward to backward, two micro-batches per step (one scale collective)."""
    kw: dict[str, Any] = {"rows": 256, "reshard": False, "accumulate": 2, "steps": 2}
    return {r: {"plain": train(r, False, **kw), "low": train(r, True, **kw)} for r in RECIPES}


def scenario_recompute(rank: int) -> dict[str, Any]:
    """Activation checkpointing: a rowwise weight's backward gather carries both copies."""
    kw: dict[str, Any] = {"checkpoint": True, "steps": 2}
    return {
        r: {"plain": train(r, False, **kw), "low": train(r, True, **kw)}
        for r in ("rowwise", "nvfp4")
    }


#: Each family of the gather's wire: square blocks (one copy), two orientations of one byte,
#: MXFP8's E8M0 scales, NVFP4's packed codes, two copies in different formats (unpacked).
FAMILIES = ("tensorwise", "rowwise", "mxfp8", "nvfp4", "fp4-fprop")


def scenario_matrix(rank: int) -> dict[str, Any]:
    """Every family, ``recompute`` (with activation checkpointing) True and False,
    ``reshard_after_forward`` True and False, with and without the gather, whatever the world
    size (one rank included: FSDP2 issues no collective there)."""
    out: dict[str, Any] = {}
    for r in FAMILIES:
        for recompute in (True, False):
            for reshard in (True, False):
                kw: dict[str, Any] = {"checkpoint": recompute, "reshard": reshard}
                key = f"{r}/recompute={recompute}/reshard={reshard}"
                out[key] = {"plain": train(r, False, **kw), "low": train(r, True, **kw)}
    return out


def scenario_reshard_later(rank: int) -> dict[str, Any]:
    """``set_reshard_after_forward`` after the first gather, rowwise (two copies): to True, the
    gathers carry both copies still (bitwise); to False, refused by name (the gathers carried one
    copy at a time, and FSDP2 sized its buffers for one)."""
    from mixprec.errors import ConfigError

    kw: dict[str, Any] = {"reshard": False, "reshard_later": True}
    out: dict[str, Any] = {"to_true": {"plain": train("rowwise", False, **kw)}}
    out["to_true"]["low"] = train("rowwise", True, **kw)
    out["to_false"] = None
    try:
        train("rowwise", True, reshard=True, reshard_later=False)
    except ConfigError as error:
        out["to_false"] = str(error)
    return out


def scenario_reshard_int(rank: int) -> dict[str, Any]:
    """``reshard_after_forward=2`` on 4 ranks (resharded to 2 after forward): refused by name
    at set up."""
    from torch.distributed.fsdp import fully_shard

    from mixprec.errors import ConfigError

    model = make_model(384)
    for i in (0, 2, 4):
        fully_shard(model[i], reshard_after_forward=2)
    fully_shard(model)
    try:
        gather_low_precision(model, policy_for("rowwise"))
    except ConfigError as error:
        return {"error": str(error)}
    return {"error": None}


def scenario_optimizers(rank: int) -> dict[str, Any]:
    """AdamW foreach and fused (alternating over the recipes): the scales follow every step."""
    kinds = ("foreach", "fused")
    return {
        r: {"plain": train(r, False, optim=o, steps=3), "low": train(r, True, optim=o, steps=3)}
        for r, o in zip(RECIPES, kinds * 3, strict=True)
    }


def scenario_compiled(rank: int) -> dict[str, Any]:
    """``torch.compile`` of the sharded model, with and without the gather, against eager."""
    from torch._dynamo.utils import counters

    out: dict[str, Any] = {}
    for r in ("tensorwise", "mxfp8", "nvfp4"):  # the later ones reuse the first's graphs
        counters.clear()
        low = train(r, True, compiled=True)
        low["graphs"] = counters["stats"]["unique_graphs"]
        out[r] = {"eager": train(r, False), "plain": train(r, False, compiled=True), "low": low}
    return out


def scenario_one_group(rank: int) -> dict[str, Any]:
    """One FSDP2 group for the whole model: the ruled weights' codes (uint8) gathered with bf16
    parameters (the biases, the bf16 Linear) in the same all-gather."""
    recipes = ("tensorwise", "mxfp8", "nvfp4")
    kw: dict[str, Any] = {"one_group": True}
    return {r: {"plain": train(r, False, **kw), "low": train(r, True, **kw)} for r in recipes}


def scenario_scaler(rank: int) -> dict[str, Any]:
    """fp16 with a GradScaler: an inf on one rank skips the step on both, with the gather too
    (the weights do not change, so no scale collective either)."""
    kw: dict[str, Any] = {"scaler": True, "steps": 3}
    return {r: {"plain": train(r, False, **kw), "low": train(r, True, **kw)} for r in ("mxfp8",)}


def scenario_no_recompute(rank: int) -> dict[str, Any]:
    """Activation checkpointing of a rowwise Linear without recompute=True: refused, by name."""
    from mixprec.errors import ConfigError

    model = shard(make_model(384), True)
    policy = policy_for("rowwise")
    gather_low_precision(model, policy)
    x, y = batch(rank, 0)
    with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
        out = forward(model, x, True)
    try:
        (out.float() - y).square().mean().backward()
    except ConfigError as error:
        return {"error": str(error)}
    return {"error": None}


def _ckpt_model(gather: bool) -> tuple[nn.Module, Any]:
    model = shard(make_model(384), True)
    handle = gather_low_precision(model, policy_for("mxfp8")) if gather else None
    return model, handle


def scenario_ckpt_save(rank: int) -> dict[str, Any]:
    """Train with the gather, then save: state_dict holds plain tensors; DCP saves them, and
    ``torch.save`` each rank's local shards (the test loads both where mixprec cannot import)."""
    import pickle

    import torch.distributed.checkpoint as dcp

    model, _ = _ckpt_model(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x, y = batch(rank, step)
        with mixprec.autocast("cpu", torch.bfloat16, policy=policy_for("mxfp8")):
            loss = (model(x).float() - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    locals_ = [v._local_tensor for v in state.values()]
    dcp.save({"model": state}, checkpoint_id=str(OUTDIR / "dcp"))
    torch.save({k: v.to_local() for k, v in state.items()}, OUTDIR / f"local-{rank}.pt")
    return {
        "local_types": sorted({type(t).__name__ for t in locals_}),
        "attributes": sorted({k for t in locals_ for k in vars(t)}),
        "pickled": len(pickle.dumps(state)) > 0,
        "params": {k: full(v) for k, v in state.items()},
    }


def scenario_ckpt_load(rank: int) -> dict[str, Any]:
    """Another world size loads the checkpoint (with the gather on), then trains a step."""
    import torch.distributed.checkpoint as dcp

    plain, _ = _ckpt_model(False)  # FSDP2 alone: nothing of mixprec in the loading model
    plain_state = {"model": plain.state_dict()}
    dcp.load(plain_state, checkpoint_id=str(OUTDIR / "dcp"))
    model, handle = _ckpt_model(True)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(OUTDIR / "dcp"))
    model.load_state_dict(state["model"])
    loaded = {k: full(v) for k, v in model.state_dict().items()}
    loaded_plain = {k: full(v) for k, v in plain.state_dict().items()}
    assert handle is not None
    return {
        "params": loaded,
        "plain_params": loaded_plain,
        "loss": _loss_and_grads(model, rank),
        "plain_loss": _loss_and_grads(plain, rank),  # the same step without the gather
        "collectives": handle.collectives,
    }


def _loss_and_grads(model: nn.Module, rank: int) -> list[torch.Tensor]:
    x, y = batch(rank, 7)
    with mixprec.autocast("cpu", torch.bfloat16, policy=policy_for("mxfp8")):
        loss = (model(x).float() - y).square().mean()
    loss.backward()
    return [loss.detach(), *(full(p.grad) for p in model.parameters())]


SCENARIOS: dict[str, Callable[[int], Any]] = {
    name[len("scenario_") :]: fn for name, fn in globals().items() if name.startswith("scenario_")
}


if __name__ == "__main__":
    run_rank(sys.argv[1:], scenarios_of(globals()), timeout_s=60)
