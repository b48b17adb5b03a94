"""mixprec.Schedule: the policy of each phase of training, one call per step; a compiled model
recompiles once per distinct policy of the schedule, never when a phase's policy comes back;
the state round-trips (state_dict, pickle, deepcopy)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.autocast_helpers import graphs
from torch import nn
from torch._dynamo.utils import counters

import mixprec
from mixprec import Policy, Schedule
from mixprec.errors import ConfigError

BF16 = torch.bfloat16
LATE = Policy("nn.Linear=nvfp4").with_matmuls(fprop="bf16")


def test_each_step_gets_its_phase_policy_the_same_object() -> None:
    early = Policy("nn.Linear=nvfp4")
    s = Schedule({0: early, 0.85: early.with_matmuls(fprop="bf16")}, total_steps=200)
    assert s.phases[1][0] == 170
    assert all(s.at(i) is early for i in range(170))
    assert all(s.at(i) is s.at(170) for i in range(170, 400))
    assert str(s.at(199)) == "nn.Linear=bf16/nvfp4/nvfp4"
    assert Schedule("nn.Linear=fp8").at(10) == Policy("nn.Linear=fp8")
    assert Schedule(None).at(3) is None
    assert Schedule([(10, "nn.Linear=fp8"), (0, None)]).at(9) is None


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 1000), max_size=5, unique=True), st.integers(0, 1200))
def test_at_is_the_last_phase_started(starts: list[int], step: int) -> None:
    """Property: the policy of a step is that of the latest phase starting at or before it."""
    policies = {0: Policy("nn.Linear=fp8"), **{s: Policy(f"{s}=bf16") for s in starts}}
    schedule = Schedule(policies)
    started = max(s for s in policies if s <= step)
    assert schedule.at(step) is policies[started]


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (({1: "nn.Linear=fp8"},), {}, "must start at step 0"),
        (({0: None, 0.5: "nn.Linear=fp8"},), {}, "needs total_steps"),
        (({0: None, 1.5: "nn.Linear=fp8"},), {"total_steps": 10}, r"fraction of total_steps"),
        (({0: None, -3: None},), {}, "negative step"),
        (({0: None, 0.5: None},), {"total_steps": 0}, "total_steps must be"),
        (({0: 3},), {}, "a phase's policy is"),
        (([(0, None), (0, "nn.Linear=fp8")],), {}, "two phases start at step 0"),
        ((42,), {}, "phases must be"),
        (([(0,)],), {}, r"a \(start, policy\) pair"),
    ],
)
def test_bad_phases_are_refused_by_name(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Schedule(*args, **kwargs)


def test_at_refuses_a_step_that_is_not_one() -> None:
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ConfigError, match="step must be an int"):
            Schedule(None).at(bad)  # type: ignore[arg-type]


def test_switch_adds_a_phase_up_to_the_next_planned_one() -> None:
    early, late = Policy("nn.Linear=nvfp4"), LATE
    s = Schedule({0: early, 100: late})
    mid = Policy("nn.Linear=mxfp8")
    s.switch(40, mid)
    assert [p for _, p in s.phases] == [early, mid, late]
    assert s.at(39) is early and s.at(40) is mid and s.at(100) is late
    s.switch(40, "nn.Linear=fp8")
    assert str(s.at(40)) == "nn.Linear=fp8" and len(s.phases) == 3


def test_state_round_trips_through_state_dict_pickle_and_deepcopy() -> None:
    s = Schedule({0: "nn.Linear=nvfp4", 0.5: LATE}, total_steps=10)
    s.switch(7, Policy("lm_head=bf16", strict=False))
    back = Schedule(None)
    back.load_state_dict(s.state_dict())
    assert back == s and back.at(8).strict is False
    assert pickle.loads(pickle.dumps(s)) == s
    assert copy.deepcopy(s) == s and copy.deepcopy(s) is not s
    with pytest.raises(ConfigError, match=r"not a Schedule\.state_dict"):
        back.load_state_dict({"phases": 3})
    assert "5: 'nn.Linear=bf16/nvfp4/nvfp4'" in repr(s)


# ---------------------------------------------------------------- under torch.compile
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global")
def test_a_compiled_loop_recompiles_once_per_distinct_policy() -> None:
    """A schedule of three phases over two distinct policies (the first comes back): two
    graphs, and each step bitwise the eager model under the same schedule."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager")
    early = Policy("nn.Linear=mxfp8")
    schedule = Schedule([(0, early), (3, early.with_matmuls(fprop="bf16")), (6, early)])
    x = torch.randn(64, 32)
    seen = []
    with graphs() as found:
        for step in range(9):
            outs = []
            for m in (compiled, twin):
                with mixprec.autocast("cpu", BF16, policy=schedule.at(step)):
                    y = m(x)
                y.float().square().mean().backward()
                outs.append((y.detach(), [p.grad.clone() for p in m.parameters()]))
                m.zero_grad()
            assert torch.equal(outs[0][0], outs[1][0]), step
            assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1], strict=True))
            seen.append(counters["stats"]["unique_graphs"])
    assert found["graphs"] == 2, seen


@pytest.mark.parametrize(
    ("phases", "match"),
    [
        ({0: None, 100: "nn.Linear=fp8"}, r"step 100\) never runs: training has total_steps=100"),
        ({0: None, 0.999: "nn.Linear=fp8"}, r"0\.999 \(step 100\) never runs"),
        ({0: None, 0.001: "nn.Linear=fp8"}, r"two phases start at step 0 \(given as 0 and 0\.001"),
    ],
)
def test_a_phase_that_would_never_run_or_clashes_after_rounding_is_named(
    phases: dict, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        Schedule(phases, total_steps=100)


def test_with_matmuls_refuses_a_policy_with_nothing_to_change() -> None:
    with pytest.raises(ConfigError, match="no fp8-family module rule"):
        Policy("nn.Linear=bf16").with_matmuls(fprop="bf16")
    with pytest.raises(ConfigError, match="output cast goes after the whole rule"):
        mixprec.Rule("mxfp8@fp32/mxfp8/nvfp4")
