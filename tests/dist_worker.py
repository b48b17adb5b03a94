"""One rank of the 2-process gloo worlds that tests/scaler/test_distributed.py spawns.

Usage: ``python dist_worker.py RANK WORLD_SIZE PORT_FILE OUTDIR SCENARIO [SCENARIO ...]``.
Each scenario writes ``OUTDIR/<scenario>-<rank>.pt`` (a dict of plain values and tensors) that
the test reads; the test process does all the asserting. Rank 0 also runs the single-process
references.
"""

from __future__ import annotations

import math
import os
import pickle
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mixprec
from mixprec.distributed import JoinableScaler, distributed_clip_grad_norm_

ITERS = 8
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 2


def batch(rank: int, it: int, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic batch of one rank at one iteration."""
    gen = torch.Generator().manual_seed(1000 * it + rank)
    return torch.randn(rows, 8, generator=gen), torch.randn(rows, 1, generator=gen)


def full_batch(it: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both ranks' batches, concatenated: what a single-process run sees."""
    xs, ys = zip(*(batch(r, it) for r in range(2)), strict=True)
    return torch.cat(xs), torch.cat(ys)


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return (out.float() - y).pow(2).mean()


def poison_(grad: torch.Tensor) -> None:
    """Put an inf into this rank's (local) part of ``grad``."""
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    if local.numel():
        local.view(-1)[0] = math.inf


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: Any,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    poison_at: set[int],
    iters: range,
    unscale: bool = False,
    clip: float | None = None,
) -> dict[str, Any]:
    """The training loop every scenario uses; records scale and skip per iteration."""
    scales, skipped, norms = [], [], []
    for it in iters:
        x, y = batches(it)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss_of(model, x, y)).backward()
        if it in poison_at:
            poison_(next(model.parameters()).grad)
        if unscale:
            scaler.unscale_(opt)
        if clip is not None:  # the norm, and torch's norm of this rank's unscaled grads
            grads = [q.grad / scaler.get_scale() for q in model.parameters()]
            norms.append(float(torch.nn.utils.get_total_norm(grads)))
            norms.append(float(scaler.clip_grad_norm_(opt, clip)))
        before = steps_taken(opt)
        scaler.step(opt)
        scaler.update()
        skipped.append(steps_taken(opt) == before)
        scales.append(scaler.get_scale())
    return {"scales": scales, "skipped": skipped, "norms": norms}


def steps_taken(opt: torch.optim.Optimizer) -> float:
    """Adam's step count of the first parameter (0 before the first step), SGD's -param[0]."""
    param = opt.param_groups[0]["params"][0]
    if isinstance(opt, torch.optim.SGD):
        return -float(param.detach().view(-1)[0])
    step = opt.state.get(param, {}).get("step")
    if step is None:
        return 0.0
    return float(step.full_tensor() if hasattr(step, "full_tensor") else step)


def full_params(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(p.detach().clone())
    return out


def reference(poison_at: set[int], fused: bool = False) -> dict[str, Any]:
    """Single process, full batch, ``torch.amp.GradScaler`` (the oracle)."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    out = train(model, opt, scaler, full_batch, poison_at, range(ITERS))
    return {**out, "params": full_params(model)}


def scaler_for(group: Any = None) -> mixprec.GradScaler:
    return mixprec.GradScaler(
        "cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, process_group=group
    )


def record(scaler: mixprec.GradScaler, out: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """What every scenario reports: its trajectory, the scaler's state and collective count."""
    stats = scaler.stats()
    return {
        **out,
        **extra,
        "state": scaler.state_dict(),
        "steps_taken": stats.steps_taken,
        "steps_skipped": stats.steps_skipped,
        "collectives": scaler._dist.total_collectives,
    }


# ---------------------------------------------------------------------- scenarios


def scenario_ddp(rank: int) -> dict[str, Any]:
    """DDP, inf on rank 1 only (after the gradient all-reduce) at iterations 2 and 5."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = scaler_for(dist.group.WORLD)
    poison = {2, 5} if rank == 1 else set()
    out = train(model, opt, scaler, lambda it: batch(rank, it), poison, range(ITERS))
    extra = {"reference": reference({2, 5})} if rank == 0 else {}
    return record(scaler, out, params=full_params(model.module), **extra)


def scenario_fsdp2(rank: int) -> dict[str, Any]:
    """FSDP2 (fp32 shards, fp16 autocast), no process_group given: the DTensor mesh is used."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = scaler_for(None)
    poison = {1, 4} if rank == 0 else set()
    out = train(model, opt, scaler, lambda it: batch(rank, it), poison, range(ITERS))
    extra = {"reference": reference({1, 4})} if rank == 0 else {}
    params = full_params(model)
    return record(scaler, out, params=params, norms=clip_norms(model), **extra)


def full_norm(model: nn.Module, p: float) -> float:
    """torch's norm of the gathered grads (get_total_norm fails on empty shards for inf)."""
    grads = [q.grad.full_tensor() for q in model.parameters()]
    return float(torch.nn.utils.get_total_norm(grads, p))


def clip_norms(model: nn.Module) -> dict[str, float]:
    """distributed_clip_grad_norm_ against torch's norm of the DTensor grads, p=2 and inf."""
    norms = {}
    for p in (2.0, math.inf):
        model.zero_grad()
        loss_of(model, *batch(dist.get_rank(), 99)).backward()
        norms[f"torch_{p}"] = full_norm(model, p)
        max_norm = norms[f"torch_{p}"] / 4
        norms[f"mixprec_{p}"] = float(distributed_clip_grad_norm_(model.parameters(), max_norm, p))
        norms[f"after_{p}"] = full_norm(model, p) / max_norm
        # scaler.clip_grad_norm_ (fused unscale+clip) on DTensor grads: the same global norm
        scaler = mixprec.GradScaler(init_scale=INIT_SCALE)
        model.zero_grad()
        scaler.scale(loss_of(model, *batch(dist.get_rank(), 99))).backward()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        norms[f"scaler_{p}"] = float(scaler.clip_grad_norm_(opt, math.inf, p))
        scaler.update()
    return norms


def scenario_fsdp2_fp16_policy(rank: int) -> dict[str, Any]:
    """FSDP2, MixedPrecisionPolicy(param_dtype=fp16), CPUOffloadPolicy, fused Adam, unscale_."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = make_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=False)  # grads offloaded (a no-op move on a CPU box)
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=policy, offload_policy=offload)
    fully_shard(model, mp_policy=policy, offload_policy=offload)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    scaler = scaler_for(None)
    poison = {3} if rank == 1 else set()
    out = train(model, opt, scaler, lambda it: batch(rank, it), poison, range(ITERS), True)
    return record(scaler, out)


def scenario_fused(rank: int) -> dict[str, Any]:
    """torch's ShardedGradScaler bugs 1 and 2: fused Adam, inf on rank 0 only, per-rank grads."""
    result = {}
    for unscale in (False, True):
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        scaler = scaler_for(dist.group.WORLD)
        poison = {1, 4} if rank == 0 else set()
        out = train(model, opt, scaler, lambda it: batch(rank, it), poison, range(ITERS), unscale)
        result["unscale" if unscale else "plain"] = record(scaler, out)
    return result


def scenario_clip(rank: int) -> dict[str, Any]:
    """scaler.clip_grad_norm_/clip_grad_value_ with per-rank grads (ZeRO-like) and a group."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = scaler_for(dist.group.WORLD)
    out: dict[str, list] = {"norms": [], "oracle": [], "clipped_ok": [], "skipped": []}
    for it, (how, poisoned) in enumerate(
        [(2.0, -1), (math.inf, -1), (2.0, 0), ("v", 1), ("v", -1)]
    ):
        opt.zero_grad()
        scaler.scale(loss_of(model, *batch(rank, it))).backward()
        if poisoned == rank:
            poison_(model[0].weight.grad)
        unscaled = [q.grad / scaler.get_scale() for q in model.parameters()]
        if how == "v":
            scaler.clip_grad_value_(opt, 0.01)
            want = [g.clamp(-0.01, 0.01) for g in unscaled]
        else:
            out["norms"].append(float(scaler.clip_grad_norm_(opt, 0.1, how)))
            out["oracle"].append(gathered_norm(unscaled, how))  # torch's norm of all ranks' grads
            want = [g * min(1.0, 0.1 / (out["oracle"][-1] + 1e-6)) for g in unscaled]
        got = [q.grad for q in model.parameters()]
        ok = all(torch.allclose(a, b, rtol=1e-4) for a, b in zip(got, want, strict=True))
        out["clipped_ok"].append(ok)
        before = steps_taken(opt)
        scaler.step(opt)
        scaler.update()
        out["skipped"].append(steps_taken(opt) == before)
    return record(scaler, {**out, "scales": []})


def gathered_norm(grads: list[torch.Tensor], p: float) -> float:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [g.clone() for g in grads])
    return float(torch.nn.utils.get_total_norm([g for gs in everyone for g in gs], p))


def scenario_fsdp1(rank: int) -> dict[str, Any]:
    """FSDP1 with fp16 MixedPrecision and keep_low_precision_grads (fp16 grads, fp32 params)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision

    policy = MixedPrecision(torch.float16, torch.float16, keep_low_precision_grads=True)
    model = FSDP(make_model(), device_id=torch.device("cpu"), mixed_precision=policy)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)  # Adam rejects fp16 grads of fp32 params
    scaler = scaler_for(dist.group.WORLD)
    poison = {2} if rank == 1 else set()
    out = train(model, opt, scaler, lambda it: batch(rank, it), poison, range(ITERS), True)
    grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    return record(scaler, out, grad_dtypes=grad_dtypes)


def scenario_join(rank: int) -> dict[str, Any]:
    """Uneven inputs: rank 0 has 3 batches, rank 1 has 8, inf on rank 1 at iteration 5."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    result = {}
    for clip in (None, 1.0):  # shadow iterations replay a found-inf MAX, or a clipping's norm
        model = DDP(make_model())
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        scaler = scaler_for(dist.group.WORLD if clip is None else None)  # DDP needs no group
        poison = {5} if rank == 1 else set()
        with Join([model, JoinableScaler(scaler)]):
            iters = range(3 if rank == 0 else ITERS)
            data = lambda it: batch(rank, it)  # noqa: E731
            out = train(model, opt, scaler, data, poison, iters, clip=clip)
        name = "plain" if clip is None else "clip"
        result[name] = record(scaler, out, history_len=scaler.stats().iterations)
    return result


def _ddp_setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model())
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _ckpt_path(rank: int) -> Path:
    return OUTDIR / f"ckpt-{rank}.pt"


def scenario_ckpt_save(rank: int) -> dict[str, Any]:
    """DDP; checkpoint after iteration 3 (mid growth interval), then the uninterrupted rest."""
    model, opt = _ddp_setup()
    scaler = scaler_for(dist.group.WORLD)
    poison = {2, 5} if rank == 1 else set()
    train(model, opt, scaler, lambda it: batch(rank, it), poison, range(4))
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}
    torch.save(state, _ckpt_path(rank))
    out = train(model, opt, scaler, lambda it: batch(rank, it), poison, range(4, ITERS))
    return record(scaler, out, params=full_params(model.module))


def scenario_ckpt_resume(rank: int) -> dict[str, Any]:
    """Fresh processes: load the checkpoint of ckpt_save and run the same iterations."""
    model, opt = _ddp_setup()
    scaler = scaler_for(None)
    state = torch.load(_ckpt_path(rank), weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    scaler.load_state_dict(state["scaler"])
    scaler.process_group = dist.group.WORLD  # not part of the checkpoint
    poison = {2, 5} if rank == 1 else set()
    out = train(model, opt, scaler, lambda it: batch(rank, it), poison, range(4, ITERS))
    copy = pickle.loads(pickle.dumps(scaler))
    same = copy.state_dict() == scaler.state_dict()
    return record(scaler, out, params=full_params(model.module), pickled=(copy.process_group, same))


SCENARIOS: dict[str, Callable[[int], Any]] = {
    name[len("scenario_") :]: fn for name, fn in globals().items() if name.startswith("scenario_")
}
OUTDIR = Path(".")


def rendezvous(rank: int, world: int, port_file: Path) -> dist.Store:
    """A TCPStore on 127.0.0.1: rank 0 binds a free port itself (no race with other programs)
    and publishes it in ``port_file``; the other ranks wait for the file."""
    from datetime import timedelta

    timeout = timedelta(seconds=30)
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        tmp.rename(port_file)  # atomic: readers never see a half-written port
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not publish its port in {port_file}")
        time.sleep(0.05)
    port = int(port_file.read_text())
    return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)


def run_rank(
    argv: list[str], body: Callable[[int, int, Path, list[str]], None], timeout_s: float = 30
) -> None:
    """One rank's whole life: ``argv`` is ``RANK WORLD PORT_FILE OUTDIR [ARGS...]``; join the
    gloo world, run ``body(rank, world, outdir, args)``, meet the other ranks, tear the group
    down, and leave with ``os._exit``: the interpreter's own teardown would destroy gloo's
    threads in an unspecified order, which now and then aborts a rank that finished its work
    ("terminate called without an active exception"). An exception prints its traceback and
    exits with 1."""
    from datetime import timedelta

    rank, world = int(argv[0]), int(argv[1])
    port_file, outdir = Path(argv[2]), Path(argv[3])
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)  # FSDP's and DTensor's notes about CPU use
    code = 1
    try:
        store = rendezvous(rank, world, port_file)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        try:
            body(rank, world, outdir, argv[4:])
            dist.barrier()
        finally:
            dist.destroy_process_group()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def scenarios_of(namespace: dict[str, Any]) -> Callable[[int, int, Path, list[str]], None]:
    """The body that runs a worker's scenarios (its ``SCENARIOS``; its ``OUTDIR`` set first),
    each saved as ``OUTDIR/<scenario>-<rank>.pt``, the ranks meeting after each."""

    def body(rank: int, world: int, outdir: Path, names: list[str]) -> None:
        namespace["OUTDIR"] = outdir
        for name in names:
            torch.save(namespace["SCENARIOS"][name](rank), outdir / f"{name}-{rank}.pt")
            dist.barrier()

    return body


if __name__ == "__main__":
    run_rank(sys.argv[1:], scenarios_of(globals()))
