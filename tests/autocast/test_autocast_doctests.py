"""The docstring examples of mixprec.autocast run, and state containers round-trip."""

from __future__ import annotations

import copy
import doctest
import importlib
import pickle

import pytest
import torch
from tests.autocast_helpers import MLP
from torch import nn

import mixprec

MODULES = [
    "mixprec._src.caller",
    "mixprec._src.autocast.casting",
    "mixprec._src.autocast.custom",
    "mixprec._src.autocast.fp8",
    "mixprec._src.autocast.calls",
    "mixprec._src.autocast.modules",
    "mixprec._src.autocast.traced",
    "mixprec._src.autocast.tree",
    "mixprec._src.autocast.native",
    "mixprec._src.autocast.ops",
    "mixprec._src.autocast.policy",
    "mixprec._src.autocast.region",
    "mixprec._src.autocast.report",
    "mixprec._src.autocast.rules",
    "mixprec._src.autocast.targets",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no runnable example"


def test_policy_and_rule_round_trip_through_pickle_and_deepcopy() -> None:
    policy = mixprec.Policy(
        modules={nn.LayerNorm: "fp32", "enc.*": mixprec.Rule(torch.bfloat16, output="input")},
        ops={torch.matmul: "promote", "aten::gelu": "low"},
        strict=False,
    )
    for clone in (pickle.loads(pickle.dumps(policy)), copy.deepcopy(policy)):
        assert clone == policy
        assert str(clone) == str(policy)
        assert clone.op_table == policy.op_table
    rule = mixprec.Rule("fp32", output="low")
    assert pickle.loads(pickle.dumps(rule)) == rule


def test_model_with_rule_hooks_deepcopies_and_pickles() -> None:
    torch.manual_seed(0)
    model = MLP()
    policy = mixprec.Policy(modules={nn.LayerNorm: "fp32"})
    x = torch.randn(2, 16)
    with mixprec.autocast("cpu", torch.bfloat16, policy=policy, report=True) as ac:
        ref = model(x)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with mixprec.autocast("cpu", torch.bfloat16, policy=policy, report=True) as ac2:
            out = clone(x)
        assert torch.equal(out, ref)
        assert ac.report is not None and ac2.report is not None
        assert ac2.report.rows == ac.report.rows
    assert mixprec.autocast.__module__ == "mixprec._src.autocast.region"
    # Nothing of a rule is stored on the model: no attribute, no hook (#32).
    for mod in model.modules():
        assert not [k for k in vars(mod) if k.startswith("_mixprec")], type(mod).__name__
        assert not mod._forward_pre_hooks and not mod._forward_hooks
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.norm(torch.randn(2, 32).bfloat16()).dtype == torch.bfloat16
