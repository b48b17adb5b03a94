"""A 16-bit part of a rule per matmul is autocast's matmul, bit for bit, in each phase.

Differential against ``torch.autocast``: a Linear under a rule whose fprop, dgrad or wgrad part
is ``bf16`` (``fp16`` in an fp16 region), the other parts a low-precision recipe, gives that
matmul's result (the output, the input's gradient, the weight's gradient) equal to the same
Linear's under ``torch.autocast`` alone, with and without a bias, on 2-D and 3-D inputs
(contiguous or not: ``F.linear`` fuses the bias only into the former's matmul), for
upstream gradients both runs receive alike (a loss linear in the output).
"""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings
from torch import nn

import mixprec

D = 64  # a multiple of every recipe's block
LOW = ["mxfp8", "fp8", "nvfp4"]
REGIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _run(
    region: torch.dtype,
    rule: str | None,
    bias: bool,
    shape: tuple[int, ...],
    seed: int,
    contiguous: bool = True,
) -> tuple[torch.Tensor, ...]:
    """(output, input grad, weight grad, bias grad) of one Linear under ``rule`` (None:
    ``torch.autocast`` alone), for ``loss = sum(out * g)``."""
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(D, D, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(D, D, generator=gen) / D**0.5)
        if bias:
            lin.bias.copy_(torch.randn(D, generator=gen))
    x = torch.randn(*shape, D, generator=gen)
    if not contiguous:  # the same values, features first in memory
        x = x.movedim(-1, 0).contiguous().movedim(0, -1)
    x.requires_grad_(True)
    g = torch.randn(*shape, D, generator=gen)
    model = nn.Sequential(lin)
    if rule is None:
        with torch.autocast("cpu", region):
            out = model(x)
    else:
        with mixprec.autocast("cpu", region, policy=mixprec.Policy(modules={"0": rule})):
            out = model(x)
    (out.float() * g).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    db = lin.bias.grad if bias else torch.zeros(())
    return out.detach(), x.grad, lin.weight.grad, db


@settings(max_examples=40, deadline=None)
@given(
    high=st.lists(st.booleans(), min_size=3, max_size=3).filter(lambda h: not all(h)),
    low=st.sampled_from(LOW),
    region=st.sampled_from(sorted(REGIONS)),
    bias=st.booleans(),
    shape=st.sampled_from([(40,), (3, 24), (1,)]),
    seed=st.integers(0, 3),
    contiguous=st.booleans(),
)
def test_a_16_bit_part_is_autocast_s_matmul_bitwise(
    high: list[bool],
    low: str,
    region: str,
    bias: bool,
    shape: tuple[int, ...],
    seed: int,
    contiguous: bool,
) -> None:
    rule = "/".join(region if h else low for h in high)
    dtype = REGIONS[region]
    got = _run(dtype, rule, bias, shape, seed, contiguous)
    want = _run(dtype, None, bias, shape, seed, contiguous)
    if high[0]:  # fprop: the output (and the bias gradient, the output's gradient summed)
        assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0]), rule
        assert torch.equal(got[3], want[3]), rule
    if high[1]:  # dgrad
        assert torch.equal(got[1], want[1]), rule
    if high[2]:  # wgrad
        assert torch.equal(got[2], want[2]), rule
    low_parts = [i for i, h in enumerate(high) if not h]
    assert not all(torch.equal(got[i], want[i]) for i in low_parts)  # the recipe ran
