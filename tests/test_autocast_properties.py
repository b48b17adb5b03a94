"""Property tests: the policy string form round-trips; rules never leak state out of a region."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch import nn

import mixprec
from autocast_helpers import MLP
from mixprec import Policy, Rule

CLASSES = [nn.LayerNorm, nn.Linear, nn.GELU, nn.Conv2d, nn.Sequential]
OPS = [F.softmax, torch.matmul, "aten::gelu", "Tensor.exp", "torch.addcmul", "F.layer_norm"]
COMPUTE = ["fp32", "low", "keep", torch.bfloat16, torch.float16]
OUTPUT = [None, "input", "low", torch.float32, torch.bfloat16]
globs = st.lists(st.sampled_from(["enc", "dec", "*", "0", "attn", "fc1"]), min_size=1, max_size=3)
rules = st.builds(Rule, st.sampled_from(COMPUTE), st.sampled_from(OUTPUT))
op_rules = st.builds(Rule, st.sampled_from([*COMPUTE, "promote"]), st.sampled_from(OUTPUT))


@settings(max_examples=60, deadline=None)
@given(
    classes=st.dictionaries(st.sampled_from(CLASSES), rules, max_size=3),
    names=st.dictionaries(globs.map(".".join), rules, max_size=3),
    ops=st.dictionaries(st.sampled_from(OPS), op_rules, max_size=3),
)
def test_string_form_round_trips(
    classes: dict[type[nn.Module], Rule], names: dict[str, Rule], ops: dict[object, Rule]
) -> None:
    policy = Policy(modules={**classes, **names}, ops=ops)
    assert Policy(str(policy)) == policy
    assert str(Policy(str(policy))) == str(policy)
    assert len(policy.op_rules) == len(ops)


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
    with mixprec.autocast("cpu", dtype, policy=Policy(modules={target: rule})):
        inside = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        try:
            out = model(torch.randn(2, 16))
            assert out.isfinite().all()
        except RuntimeError as err:  # "keep" leaves dtypes to the module: a mismatch is allowed
            assert rule.compute == "keep" and "same dtype" in str(err)
        assert inside == (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        assert torch.is_autocast_cache_enabled()
    assert not torch.is_autocast_enabled("cpu")
