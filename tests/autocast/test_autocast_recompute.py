"""Checkpoint recomputation computes exactly what the forward did: every checkpoint kind, with
and without a policy, a weight shared by two checkpointed regions (pytorch#193338)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import mixprec
from mixprec import Policy
from mixprec._src.torch_compat import TORCH_RELEASE

BF16 = torch.bfloat16
aten = torch.ops.aten


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in (aten.mm.default, aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


SAC = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
RUN: dict[str, Callable[[Callable[..., Any], torch.Tensor], Any]] = {
    "none": lambda fn, h: fn(h),
    "plain": lambda fn, h: checkpoint(fn, h, use_reentrant=False),
    "reentrant": lambda fn, h: checkpoint(fn, h, use_reentrant=True),
    "selective": lambda fn, h: checkpoint(fn, h, use_reentrant=False, context_fn=SAC),
}
POLICIES = {
    "no policy": None,
    "fp32 module rule": Policy(modules={nn.LayerNorm: "fp32"}),
    "op rule": Policy(ops={torch.relu: "fp32"}),
    "both": Policy("nn.LayerNorm=fp32, torch.relu=fp32@input, F.gelu=bf16"),
}


class Shared(nn.Module):
    """A block applied twice, each time in its own checkpointed region: one weight, two regions.
    The region is a plain function, so op rules act between modules."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return F.gelu(torch.relu(self.norm(self.lin(h)))) + h

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        h = self.stem(x)
        for _ in range(2):
            h = RUN[mode](self.block, h)
        return self.head(h)


def _step(
    net: nn.Module, mode: str, region: Callable[[], Any], x: torch.Tensor
) -> list[torch.Tensor]:
    net.zero_grad(set_to_none=True)
    with region():
        out = net(x, mode)
    out.float().square().mean().backward()
    return [out.detach(), *(p.grad for p in net.parameters() if p.grad is not None)]


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        s.dtype == t.dtype and torch.equal(s, t) for s, t in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("policy", POLICIES, ids=list(POLICIES))
def test_every_checkpoint_kind_recomputes_exactly(policy: str) -> None:
    torch.manual_seed(0)
    net, x = Shared(), torch.randn(4, 8)

    def region() -> Any:
        return mixprec.autocast("cpu", BF16, policy=POLICIES[policy])

    reference = _step(net, "none", region, x)
    assert len(reference) == 1 + 8
    for mode in ("plain", "reentrant", "selective"):
        assert _bitwise(_step(net, mode, region, x), reference), f"{mode} checkpoint differs"
    if POLICIES[policy] is not None:  # the rules did change the numerics
        plain = _step(net, "none", lambda: mixprec.autocast("cpu", BF16), x)
        assert not _bitwise(plain, reference)


def test_torch_autocast_fails_selective_checkpointing_with_a_shared_weight() -> None:
    """Why mixprec's training regions cast per use: torch's weight cache breaks this
    (pytorch#193338: torch 2.13 on raise, 2.12 computes other gradients without a word); torch's
    own workaround, cache_enabled=False, computes what mixprec does."""
    torch.manual_seed(0)
    net, x = Shared(), torch.randn(4, 8)
    no_cache = _step(net, "none", lambda: torch.autocast("cpu", dtype=BF16, cache_enabled=False), x)
    if TORCH_RELEASE >= (2, 13):
        with pytest.raises(RuntimeError, match=r"_to_copy.*not found in storage"):
            _step(net, "selective", lambda: torch.autocast("cpu", dtype=BF16), x)
    else:
        cached = _step(net, "selective", lambda: torch.autocast("cpu", dtype=BF16), x)
        assert not _bitwise(cached, no_cache)
    ours = _step(net, "selective", lambda: mixprec.autocast("cpu", BF16), x)
    assert _bitwise(ours, no_cache)


def test_the_weight_cache_is_off_where_a_backward_can_follow_only() -> None:
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    with mixprec.autocast("cpu", BF16):
        assert not torch.is_autocast_cache_enabled()
    with torch.no_grad(), mixprec.autocast("cpu", BF16):
        assert torch.is_autocast_cache_enabled()  # inference (generation loops) keeps it
        assert lin(x).dtype == BF16
    with mixprec.autocast("cpu", BF16, cache_enabled=True):
        assert torch.is_autocast_cache_enabled()  # asked for: torch's cache
    assert torch.is_autocast_cache_enabled()


def test_a_weight_used_twice_in_one_region_matches_torch_without_its_cache() -> None:
    """Outputs are torch's bit for bit; gradients are the per-use gradients summed in fp32."""
    torch.manual_seed(0)
    lin, x = nn.Linear(8, 8), torch.randn(4, 8)

    def run(region: Callable[[], Any]) -> list[torch.Tensor]:
        lin.zero_grad(set_to_none=True)
        with region():
            out = lin(torch.relu(lin(x)))
        out.float().sum().backward()
        return [out.detach(), lin.weight.grad.clone(), lin.bias.grad.clone()]

    ours = run(lambda: mixprec.autocast("cpu", BF16))
    cached = run(lambda: torch.autocast("cpu", dtype=BF16))
    assert torch.equal(ours[0], cached[0])
    assert _bitwise(ours, run(lambda: torch.autocast("cpu", dtype=BF16, cache_enabled=False)))
    assert torch.allclose(ours[1], cached[1], rtol=2e-2, atol=1e-2)  # bf16 rounding of the sum


def test_op_rules_of_an_outer_region_replay_around_a_nested_region_in_a_checkpoint() -> None:
    torch.manual_seed(0)
    lin, x = nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)
    inner = Policy(ops={F.gelu: "fp32"})

    def fn(h: torch.Tensor) -> torch.Tensor:
        h = torch.relu(lin(h))  # the outer region's rule
        with mixprec.autocast("cpu", BF16, policy=inner):  # entered again by the recompute
            return F.gelu(lin(h)) * torch.relu(h).float()

    def run(mode: str) -> list[torch.Tensor]:
        lin.zero_grad(set_to_none=True)
        x.grad = None
        with mixprec.autocast("cpu", BF16, policy=Policy(ops={torch.relu: "fp32@input"})):
            out = RUN[mode](fn, x)
        out.square().mean().backward()
        return [out.detach(), x.grad.clone(), lin.weight.grad.clone()]

    reference = run("none")
    for mode in ("plain", "reentrant", "selective"):
        assert _bitwise(run(mode), reference), mode
