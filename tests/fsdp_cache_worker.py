"""One rank of the gloo world that tests/fp8/test_fsdp_gather.py's cache tests spawn: the
gathered weight as a cache, never a value. Each variant trains a small model with and without
the low-precision all-gather; the parameters changed in place every way between steps, the
forward entered two ways, the weight read by other readers than its rule's matmul and run under
other rules than the gather's, a Linear with fewer rows than ranks.

Usage: ``python fsdp_cache_worker.py RANK WORLD_SIZE PORT_FILE OUTDIR SCENARIO [SCENARIO ...]``.
Each scenario writes ``OUTDIR/<scenario>-<rank>.pt``; the test does all the asserting.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec
from dist_worker import run_rank, scenarios_of
from fsdp_gather_worker import counting, counts, full, word
from mixprec.distributed import gather_low_precision

OUTDIR = Path(".")


class Net(nn.Sequential):
    """Two Linears (the first of a chosen class) with a method FSDP2 may wrap as a forward."""

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class Lora(nn.Linear):
    """A served LoRA form: the merged weight ``W + B @ A`` reaches the Linear's matmul."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__(i, o)
        self.lora_a = nn.Parameter(torch.randn(4, i) * 0.05)
        self.lora_b = nn.Parameter(torch.randn(o, 4) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight + self.lora_b @ self.lora_a, self.bias)


class TMatmul(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


class Normed(nn.Linear):
    """Its forward reads the weight in an op that is no matmul (a penalty-like term)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.weight.float().square().mean()


class Shared(nn.Module):
    """One Linear registered as ``a`` and ``b`` (called through ``a``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(128, 64)
        self.b = self.a
        self.c = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.gelu(self.a(x)))


class Tied(nn.Module):
    """An Embedding whose weight is the ruled head's (one parameter, one FSDP2 group)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 128)
        self.body = nn.Linear(128, 128)
        self.head = nn.Linear(128, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.body(self.emb(idx))))


def net(first: type[nn.Linear] = nn.Linear, rows: int = 64) -> Net:
    torch.manual_seed(0)
    return Net(first(128, rows), nn.GELU(), nn.Linear(rows, 32))


def shard_children(model: nn.Module) -> nn.Module:
    """Each direct child holding parameters its own FSDP2 group (bf16), then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if not isinstance(model, Tied):  # the tied weight: one group for both of its modules
        for child in {id(c): c for c in model.children()}.values():
            if any(True for _ in child.parameters()):
                fully_shard(child, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def change_(model: nn.Module, how: str, ckpt: Path) -> None:
    """Change the parameters in place between steps, the way ``how`` names."""
    import torch.distributed.checkpoint as dcp

    params = list(model.parameters())
    with torch.no_grad():
        if how == "foreach_add":
            torch._foreach_add_(params, 0.125)
        elif how == "foreach_mul":
            torch._foreach_mul_(params, 3.0)
        elif how == "copy_":
            for p in params:
                p.copy_(p * -2.0)
        elif how == "data":
            for p in params:
                p.data.mul_(0.25)
        elif how == "dcp":  # back to the weights saved before the first step, in place
            dcp.load({"model": model.state_dict()}, checkpoint_id=str(ckpt))


OPTIMS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.5),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=0.05, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.05, fused=True),
}


def variant(
    build: Callable[[], nn.Module],
    low: bool,
    policies: list[mixprec.Policy],
    *,
    gather_policy: mixprec.Policy | None = None,
    how: str = "sgd",
    entry: str = "call",
    tag: str = "",
) -> dict[str, Any]:
    """Two steps of ``build()``'s model sharded, step ``i`` under ``policies[i]`` (the gather
    set up with ``gather_policy``, default the first); after each optimizer step the
    parameters change ``how``; the forward entered by calling the model or its ``score``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import register_fsdp_forward_method

    torch.manual_seed(0)
    model = shard_children(build())
    ckpt = OUTDIR / f"refresh-{tag}-{low}"
    if how == "dcp":
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt))
    handle = gather_low_precision(model, gather_policy or policies[0]) if low else None
    if entry == "method":
        register_fsdp_forward_method(model, "score")
    opt = OPTIMS.get(how, OPTIMS["sgd"])(list(model.parameters()))
    stats = mixprec.Fp8Stats()
    log: dict[str, Any] = {"losses": [], "grads": [], "calls": [], "kept": []}
    with counting(log["calls"]):
        for step, policy in enumerate(policies):
            log["calls"].append(0)
            x, y = variant_batch(model, step)
            with stats, mixprec.autocast("cpu", torch.bfloat16, policy=policy):
                out = model(x) if entry == "call" else model.score(x)  # type: ignore[operator]
            loss = (out.float() - y).square().mean()
            loss.backward()
            if handle is not None:  # the weights whose own values the handle still holds
                log["kept"].append(sum(w.payload.high is not None for w in handle.weights))
            log["losses"].append(loss.detach())
            log["grads"].append([full(p.grad) for p in model.parameters()])
            opt.step()
            opt.zero_grad()
            change_(model, how, ckpt)
    log["params"] = [full(p) for p in model.parameters()]
    log["stats_recipes"] = {k: v.recipe for k, v in stats.read().items()}
    return {**log, **(counts(handle) if handle is not None else {})}


def variant_batch(model: nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    if isinstance(model, Tied):
        return torch.randint(0, 64, (16,), generator=gen), torch.randn(16, 64, generator=gen)
    return torch.randn(16, 128, generator=gen), torch.randn(16, 32, generator=gen)


def both(build: Callable[[], nn.Module], policies: list[mixprec.Policy], **kw: Any) -> Any:
    return {
        "plain": variant(build, False, policies, **kw),
        "low": variant(build, True, policies, **kw),
    }


CHANGES = (
    "sgd",
    "adamw_foreach",
    "adamw_fused",
    "foreach_add",
    "foreach_mul",
    "copy_",
    "data",
    "dcp",
)


def scenario_refresh(rank: int) -> dict[str, Any]:
    """Every way of changing the parameters in place between steps, each through both ways into
    a forward (a call, a method FSDP2 wraps), the recipes in turn (a class rule: the method's
    forward has no root of its own)."""
    out: dict[str, Any] = {}
    cycle = ("tensorwise", "mxfp8", "nvfp4")
    for i, how in enumerate(CHANGES):
        for j, entry in enumerate(("call", "method")):
            recipe = cycle[(2 * i + j) % 3]
            policy = mixprec.Policy(modules={nn.Linear: word(recipe)})
            kw = {"how": how, "entry": entry, "tag": f"{how}-{entry}"}
            out[f"{how}/{entry}/{recipe}"] = both(net, [policy, policy], **kw)
    return out


def scenario_readers(rank: int) -> dict[str, Any]:
    """Readers of a gathered weight other than its rule's matmul, and forwards under other rules
    than the gather's (a Schedule's later phase: the second step)."""
    mx = mixprec.Policy("0=mxfp8, 2=mxfp8")
    out: dict[str, Any] = {}
    for name, cls in (("lora", Lora), ("t_matmul", TMatmul), ("norm", Normed)):
        out[name] = both(lambda c=cls: net(c), [mx, mx])
    tied = mixprec.Policy("head=mxfp8, body=mxfp8")
    out["tied"] = both(Tied, [tied, tied])
    for name, later in (
        ("nvfp4", "0=nvfp4, 2=nvfp4"),
        ("fp8", "0=fp8, 2=mxfp8"),
        ("bf16", "0=bf16"),
    ):
        out[f"then_{name}"] = both(net, [mx, mixprec.Policy(later)])
    for first, second in (("mxfp8", "nvfp4"), ("nvfp4", "mxfp8")):
        # the shared Linear's rule comes by its second name (torch's named_modules drops it),
        # ``c``'s by the class rule the shared one's name glob overrides
        policy = mixprec.Policy(f"b={second}, nn.Linear={first}")
        out[f"shared_{first}_{second}"] = both(Shared, [policy, policy])
    return out


def scenario_few_rows(rank: int) -> dict[str, Any]:
    """A ruled Linear with fewer rows than ranks (one rank holds none of its rows)."""
    out: dict[str, Any] = {}
    for recipe in ("tensorwise", "rowwise"):
        policy = mixprec.Policy(modules={"0": word(recipe), "2": word(recipe)})
        out[recipe] = both(lambda: few_rows_net(), [policy, policy])
    return out


def few_rows_net() -> nn.Module:
    torch.manual_seed(0)
    return Net(nn.Linear(128, 1), nn.GELU(), nn.Linear(1, 32))


SCENARIOS: dict[str, Callable[[int], Any]] = {
    name[len("scenario_") :]: fn for name, fn in globals().items() if name.startswith("scenario_")
}


if __name__ == "__main__":
    run_rank(sys.argv[1:], scenarios_of(globals()), timeout_s=60)
