"""Property test: no module rule leaks autocast state out of a region.

Value round-trips of policies and rules are in test_autocast_values.py.
"""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings
from tests.autocast_helpers import MLP
from torch import nn

import mixprec
from mixprec import Policy, Rule

COMPUTE = ["fp32", "low", "keep", torch.bfloat16, torch.float16]
OUTPUT = [None, "input", "low", torch.float32, torch.bfloat16]
rules = st.builds(Rule, st.sampled_from(COMPUTE), st.sampled_from(OUTPUT))


@settings(max_examples=25, deadline=None)
@given(
    rule=rules,
    target=st.sampled_from([nn.LayerNorm, nn.Linear, nn.GELU, "fc1", "norm", "fc*"]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
)
def test_any_module_rule_restores_the_native_state(
    rule: Rule, target: object, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    model = MLP()
    policy = Policy(modules={target: rule})
    with mixprec.autocast("cpu", dtype, cache_enabled=True, policy=policy):
        inside = (
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
            torch.is_autocast_cache_enabled(),
        )
        try:
            out = model(torch.randn(2, 16))
            assert out.isfinite().all()
        except RuntimeError as err:  # "keep" leaves dtypes to the module: a mismatch is allowed
            assert rule.compute == "keep" and "same dtype" in str(err)
        assert inside == (
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
            torch.is_autocast_cache_enabled(),
        )
        assert inside[2]
    assert not torch.is_autocast_enabled("cpu")
