"""Class rules of any importable class come back from ``str(policy)``, and names that match
nothing say what was meant.

``str(policy)`` writes a class outside torch.nn as ``module:Qualname`` and ``Policy`` imports it
back, so a Schedule's state_dict, a pickle and a converter config keep the rule (a property over
policies mixing torch.nn classes, Hugging Face's ``Conv1D``, classes of this module, torch
classes outside ``torch.nn``, globs and op rules); what cannot be imported is a ConfigError with
the fix; a glob or class word that matches nothing names the close module names or the class.
"""

from __future__ import annotations

import pickle

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from transformers.pytorch_utils import Conv1D

import mixprec
from mixprec import Policy, Schedule
from mixprec.errors import ConfigError


class Proj(nn.Linear):
    """A projection class of this test module (outside torch.nn)."""


class Outer:
    class Inner(nn.Module):  # a nested class: its qualified name has a dot
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x


CLASSES = [nn.Linear, nn.LayerNorm, Conv1D, Proj, Outer.Inner, NonDynamicallyQuantizableLinear]
GLOBS = ["lm_head", "h.*.attn", "blocks.[0,1].fc", "transformer.h.0"]
OPS = ["F.softmax", "torch.matmul", "aten::gelu"]
RULES = ["fp32", "bf16", "keep", "fp32@input"]


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    classes = draw(st.lists(st.sampled_from(CLASSES), unique=True, max_size=4))
    globs = draw(st.lists(st.sampled_from(GLOBS), unique=True, max_size=2))
    ops = draw(st.lists(st.sampled_from(OPS), unique=True, max_size=2))
    rule = st.sampled_from(RULES)
    modules: dict[object, str] = {k: draw(rule) for k in [*globs, *classes]}
    return Policy(modules=modules, ops={k: draw(rule) for k in ops}, strict=draw(st.booleans()))


@settings(max_examples=60, deadline=None)
@given(policy=policies(), switch_at=st.integers(1, 50))
def test_every_class_rule_reads_back_from_the_string_form(policy: Policy, switch_at: int) -> None:
    again = Policy(str(policy), strict=policy.strict)
    assert again == policy and hash(again) == hash(policy)
    assert again.class_rules == policy.class_rules  # the same class objects, imported back
    assert pickle.loads(pickle.dumps(policy)) == policy
    schedule = Schedule({0: None, switch_at: policy})
    resumed = Schedule(None)
    resumed.load_state_dict(pickle.loads(pickle.dumps(schedule.state_dict())))
    assert resumed == schedule and resumed.at(switch_at) == policy


def test_a_conv1d_rule_resumed_from_a_schedule_serves_the_gpt2_projections() -> None:
    """The case that served nothing: Hugging Face's Conv1D under an fp8 rule, through a
    Schedule's state_dict (the guard refuses a rule that serves nothing, so running is proof)."""
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(32, 32), nn.GELU(), Conv1D(32, 32))
    x = torch.randn(4, 32)
    direct = Policy(modules={Conv1D: "mxfp8"})
    resumed = Schedule(None)
    resumed.load_state_dict(Schedule(direct).state_dict())
    assert str(direct) == "transformers.pytorch_utils:Conv1D=mxfp8"
    outs = []
    for policy in (direct, resumed.at(0)):
        with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
            outs.append(model(x))
    with mixprec.autocast("cpu", torch.bfloat16):
        plain = model(x)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], plain)


def test_a_class_that_cannot_be_imported_is_refused_with_the_fix() -> None:
    def local() -> type[nn.Module]:
        class Hidden(nn.Module):
            pass

        return Hidden

    written = str(Policy(modules={local(): "fp32"}))
    cases = {
        written: "defined inside a function",
        "no_such_package_xyz.mod:Block=fp32": "cannot import 'no_such_package_xyz.mod'",
        "transformers.pytorch_utils:Conv2D=fp32": "has no nn.Module class 'Conv2D'",
        "torch.nn.functional:softmax=fp32": "has no nn.Module class 'softmax'",
    }
    for spec, what in cases.items():
        with pytest.raises(ConfigError, match=what) as info:
            Policy(spec)
        assert "package.module:ClassName" in str(info.value)  # the fix
    schedule = Schedule(None)
    state = {"phases": [(0, written, True)], "total_steps": None}
    with pytest.raises(ConfigError, match="defined inside a function"):
        schedule.load_state_dict(state)
    assert schedule.phases == ((0, None),)  # nothing half-changed


def test_a_class_word_that_matches_nothing_says_how_to_name_the_class() -> None:
    model = nn.Sequential(Conv1D(32, 32))
    for spec in ("Conv1D=fp32", "nn.Conv1D=fp32"):
        with pytest.raises(ConfigError, match=r"'transformers\.pytorch_utils:Conv1D'"):
            _run(model, spec)
    fixed = "transformers.pytorch_utils:Conv1D=fp32"
    with mixprec.autocast("cpu", policy=fixed):
        assert model(torch.randn(2, 32)).dtype == torch.float32


def _run(model: nn.Module, policy: str) -> None:
    with mixprec.autocast("cpu", policy=policy):
        model(torch.randn(2, 32))


class Wide(nn.Module):
    """Many module names, as a Hugging Face model has."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(60))
        self.lm_head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x)


@pytest.mark.parametrize(
    ("typo", "meant"), [("lm_haed", "lm_head"), ("blocks.7.wieght", None), ("blocks.70", None)]
)
def test_a_glob_that_matches_nothing_names_the_close_module_names(
    typo: str, meant: str | None
) -> None:
    model = Wide()
    names = [n for n, _ in model.named_modules() if n]
    with pytest.raises(ConfigError, match="matched no module") as info:
        Policy(f"{typo}=bf16").resolve(model)
    message = str(info.value)
    listed = [n for n in names if repr(n) in message]
    if meant is not None:
        assert f"did you mean {meant!r}" in message and listed == [meant]
    assert len(listed) <= 12  # a few names, never the whole model


def test_a_misspelt_rule_word_names_the_word_meant() -> None:
    """Every word a rule accepts (kinds, recipes, dtypes), with two neighbouring letters swapped,
    is refused with that word among the close ones; recipes and output casts alike."""
    from mixprec._src.autocast.rules import _compute_words

    tried = 0
    for word in _compute_words():
        for i in range(len(word) - 1):
            typo = word[:i] + word[i + 1] + word[i] + word[i + 2 :]
            try:
                mixprec.Rule(typo)
            except ConfigError as err:
                tried += 1
                assert f"did you mean {word!r}" in str(err) or f"or {word!r}" in str(err), typo
    assert tried > 50
    with pytest.raises(ConfigError, match="did you mean 'input'"):
        mixprec.Rule("fp32@inptu")
    with pytest.raises(ConfigError, match="did you mean 'mxfp8'"):
        mixprec.advise(
            nn.Linear(4, 4), torch.randn(2, 4), lambda m, b: m(b).sum(), candidates=["mxfp9"]
        )
