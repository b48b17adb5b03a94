"""Policies and rules are values: frozen, equal and hashed by behaviour, cheap to rebuild."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import random
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch import nn

import mixprec
from mixprec import Policy, Rule
from mixprec._src.autocast import rules as rules_mod
from mixprec.errors import ConfigError

BF16 = torch.bfloat16
CLASSES = [nn.LayerNorm, nn.Linear, nn.GELU, nn.Conv2d, nn.Embedding]
GLOBS = ["enc.*", "dec.0", "*.attn", "head", "fc1"]
OPS = [F.softmax, torch.matmul, "aten::gelu", "Tensor.exp", "torch.nn.functional.layer_norm"]
COMPUTE = ["fp32", "low", "keep", BF16, torch.float16]
OUTPUT = [None, "input", "low", torch.float32, BF16]
rules = st.builds(Rule, st.sampled_from(COMPUTE), st.sampled_from(OUTPUT))
op_rules = st.builds(Rule, st.sampled_from([*COMPUTE, "promote"]), st.sampled_from(OUTPUT))
policies = st.builds(
    lambda classes, globs, ops, strict: Policy(
        modules={**classes, **globs}, ops=ops, strict=strict
    ),
    st.dictionaries(st.sampled_from(CLASSES), rules, max_size=3),
    st.dictionaries(st.sampled_from(GLOBS), rules, max_size=3),
    st.dictionaries(st.sampled_from(OPS), op_rules, max_size=3),
    st.booleans(),
)


# ------------------------------------------------------------------ frozen
def test_a_policy_cannot_be_changed() -> None:
    p = Policy("nn.LayerNorm=fp32, enc.*=bf16, F.gelu=fp32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.strict = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.modules = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.modules[nn.Linear] = Rule("fp32")  # type: ignore[index]
    with pytest.raises(TypeError):
        p.ops["F.softmax"] = Rule("fp32")  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Rule("fp32").output = "input"  # type: ignore[misc]
    given_mapping = {nn.Linear: "fp32"}
    q = Policy(modules=given_mapping)
    given_mapping[nn.Linear] = "keep"  # the caller's dict is copied, not referenced
    assert q.modules[nn.Linear] == Rule("fp32")


def test_an_equal_policy_with_other_strictness_is_a_different_value() -> None:
    """The interned policy of one region can no longer leak a changed `strict` into another."""
    net = nn.Sequential(nn.Linear(4, 4))
    loose = mixprec.autocast("cpu", BF16, policy=Policy("enc.*=fp32", strict=False)).policy
    strict = mixprec.autocast("cpu", BF16, policy=Policy("enc.*=fp32")).policy
    assert loose is not None and strict is not None
    assert (loose.strict, strict.strict) == (False, True) and loose != strict
    with mixprec.autocast("cpu", BF16, policy=Policy("enc.*=fp32", strict=False)):
        net(torch.randn(2, 4))
    with (
        pytest.raises(ConfigError, match="ran in the region"),
        mixprec.autocast("cpu", BF16, policy=Policy("enc.*=fp32")),
    ):
        net(torch.randn(2, 4))


# ------------------------------------------------------------------ equality and hashing
def test_equality_is_over_what_changes_behaviour() -> None:
    a = Policy(modules={nn.LayerNorm: "fp32", nn.Linear: "bf16"}, ops={F.softmax: "fp32"})
    b = Policy(
        modules={nn.Linear: BF16, "nn.LayerNorm": Rule("fp32")}, ops={"Tensor.softmax": "fp32"}
    )
    assert a == b and hash(a) == hash(b)  # class-rule order and the op's spelling do not matter
    first, second = Policy("enc.*=fp32, enc.0=keep"), Policy("enc.0=keep, enc.*=fp32")
    assert first != second  # the first matching glob wins: order is behaviour
    assert first.module_rule(nn.Linear(1, 1), "enc.0") != second.module_rule(
        nn.Linear(1, 1), "enc.0"
    )
    assert Policy("F.gelu=fp32") != Policy("F.gelu=fp32@input")
    assert Policy("F.gelu=fp32") != Policy("F.gelu=fp32", strict=False)
    assert Policy("F.gelu=fp32") != "F.gelu=fp32"
    assert len({a, b, first, second}) == 3


@settings(max_examples=60, deadline=None)
@given(policy=policies)
def test_every_form_of_a_policy_is_equal_and_hashes_equal(policy: Policy) -> None:
    shuffled = dict(policy.modules)
    classes = [k for k in shuffled if isinstance(k, type)]
    random.Random(0).shuffle(classes)
    reordered = {
        **{k: shuffled[k] for k in classes},
        **{k: v for k, v in shuffled.items() if isinstance(k, str)},
    }
    forms = [
        Policy(str(policy), strict=policy.strict),
        Policy(modules=reordered, ops=dict(policy.ops), strict=policy.strict),
        dataclasses.replace(policy),
        pickle.loads(pickle.dumps(policy)),
        copy.deepcopy(policy),
    ]
    for form in forms:
        assert form == policy and hash(form) == hash(policy)
        assert form.op_table == policy.op_table
    assert str(Policy(str(policy))) == str(policy)
    flipped = dataclasses.replace(policy, strict=not policy.strict)
    assert flipped != policy and flipped.modules == policy.modules


@settings(max_examples=60, deadline=None)
@given(rule=op_rules)
def test_a_rule_round_trips_through_its_string(rule: Rule) -> None:
    assert Rule(str(rule)) == rule and hash(Rule(str(rule))) == hash(rule)
    assert eval(repr(rule), {"Rule": Rule}) == rule
    assert dataclasses.replace(rule) == rule


# ------------------------------------------------------------------ string targets
def test_function_names_in_the_string_form_are_op_rules() -> None:
    p = Policy("torch.nn.functional.softmax=fp32, torch.nn.LayerNorm=fp32, torch.Tensor.exp=fp32")
    assert p.op_table.keys() == {"softmax", "exp"}
    assert p.class_rules == {nn.LayerNorm: Rule("fp32")}
    assert str(p) == "nn.LayerNorm=fp32, F.softmax=fp32, Tensor.exp=fp32"
    x = torch.randn(2, 4)
    with mixprec.autocast("cpu", BF16, policy=p):
        h = x @ x.t()  # bf16 under native autocast
        assert F.softmax(h, -1).dtype == torch.float32
        assert h.softmax(-1).dtype == torch.float32  # the Tensor method has the same name
        assert h.exp().dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"modules": {"torch.nn.functional.softmax": "fp32"}}, r"names a function.*ops="),
        ({"modules": {"F.softmax": "fp32"}}, r"names a function.*ops="),
        ({"modules": {torch.softmax: "fp32"}}, r"is a function; op rules go in ops="),
        ({"ops": {"nn.LayerNorm": "fp32"}}, r"names a module class; module rules go in modules="),
        ({"ops": {nn.LayerNorm: "fp32"}}, r"is a module class; module rules go in modules="),
        ({"spec": "torch.nn.functional=fp32"}, "neither an nn.Module class nor a torch function"),
        ({"spec": "torch.nn.NoSuchNorm=fp32"}, "not an nn.Module class"),
        ({"spec": "torch.no_such_op=fp32"}, "unknown op"),
        ({"modules": [("x", "fp32")]}, "must be a mapping"),
        ({"strict": 1}, "strict must be True or False"),
        ({"spec": "F.gelu=fp32:fast"}, "takes no recipe"),
        ({"spec": "F.gelu=fp32@low@input"}, "unknown output cast"),
    ],
)
def test_targets_in_the_wrong_place_say_where_they_go(
    kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        Policy(**kwargs)  # type: ignore[arg-type]


def test_a_bare_function_name_is_a_module_glob_and_the_error_says_how_to_write_the_op() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ConfigError, match=r"'softmax' is read as a module name.*'F\.softmax'"):
        Policy("softmax=fp32").resolve(model)


def test_static_resolve_speaks_of_the_model_not_of_a_region() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ConfigError) as info:
        Policy("encoder.*=fp32").resolve(model)
    message = str(info.value)
    assert "matched no module of the model" in message and "region" not in message
    assert "'0', '1'" in message
    assert Policy("encoder.*=fp32", strict=False).resolve(model) == {}


def test_policy_table_accepts_the_string_form() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    from_string = mixprec.policy_table("cpu", policy="nn.Linear=fp32, F.gelu=fp32", model=model)
    from_value = mixprec.policy_table("cpu", Policy("nn.Linear=fp32, F.gelu=fp32"), model)
    assert from_string.rows == from_value.rows
    assert ("module", "0", "-", "fp32", "fp32") in from_string.rows
    with pytest.raises(ConfigError, match=r"policy must be a mixprec\.Policy"):
        mixprec.policy_table("cpu", policy=42)  # type: ignore[arg-type]


# ------------------------------------------------------------------ room for new compute kinds
def test_a_compute_kind_with_recipes_plugs_into_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """How a kind such as fp8 (recipes, modules only) is added: one entry in rules.KINDS."""
    kind = rules_mod.ComputeKind("demo", ops=False, recipes=("plain", "fancy"))
    monkeypatch.setitem(rules_mod.KINDS, "demo", kind)
    rules_mod._parse_word.cache_clear()
    rules_mod._cached_rule.cache_clear()
    try:
        default, fancy = Rule("demo"), Rule("demo:fancy")
        assert (default.compute, default.recipe, str(default)) == ("demo", "plain", "demo")
        assert (fancy.recipe, str(fancy), repr(fancy)) == (
            "fancy",
            "demo:fancy",
            "Rule('demo:fancy')",
        )
        assert Rule("demo:plain") == default and Rule("demo", recipe="fancy") == fancy
        assert dataclasses.replace(fancy, output="input") == Rule("demo:fancy@input")
        policy = Policy("nn.Linear=demo:fancy, lm_head=demo")
        assert Policy(str(policy)) == policy and str(policy) == "nn.Linear=demo:fancy, lm_head=demo"
        with pytest.raises(ConfigError, match=r'unknown recipe .*"demo:plain", "demo:fancy"'):
            Rule("demo:odd")
        with pytest.raises(ConfigError, match="accepted for ops"):
            Policy(ops={F.gelu: "demo"})
    finally:
        rules_mod._parse_word.cache_clear()
        rules_mod._cached_rule.cache_clear()


# ------------------------------------------------------------------ the policy language (#23)
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"spec": "lm_head=bf16, lm_head=fp32"}, r"conflicting module rules for 'lm_head'"),
        (
            {"spec": "nn.Linear=fp8, torch.nn.Linear=bf16"},
            r"conflicting module rules for nn\.Linear: nn\.Linear=fp8 and torch\.nn\.Linear=bf16",
        ),
        ({"spec": "lm_head=fp32", "modules": {"lm_head": "bf16"}}, "conflicting module rules"),
        ({"modules": {nn.LayerNorm: "fp32", "nn.LayerNorm": "keep"}}, "conflicting module rules"),
    ],
)
def test_conflicting_module_rules_are_refused_like_op_rules(
    kwargs: dict[str, Any], match: str
) -> None:
    spec = kwargs.pop("spec", None)
    with pytest.raises(ConfigError, match=match):
        Policy(spec, **kwargs)


def test_repeating_the_same_module_rule_is_one_rule() -> None:
    assert Policy("lm_head=fp32, lm_head=fp32") == Policy("lm_head=fp32")
    assert str(Policy("nn.Linear=fp8, torch.nn.Linear=fp8")) == "nn.Linear=fp8"


@pytest.mark.parametrize(
    "modules",
    [
        {"blocks.[0,1].fc": "fp32"},
        {"blocks.[0,1].fc": "fp32", "head.[!2,3]": "bf16@input"},
        {"a.[,]": "keep", nn.LayerNorm: "fp32"},
    ],
)
def test_globs_with_commas_round_trip_through_the_string_form(modules: dict[Any, str]) -> None:
    policy = Policy(modules=modules, ops={"F.gelu": "fp32"})
    assert Policy(str(policy)) == policy
    assert str(Policy(str(policy))) == str(policy)


def test_a_comma_glob_matches_what_fnmatch_matches() -> None:
    net = nn.Module()
    net.blocks = nn.ModuleList(nn.Module() for _ in range(3))
    for block in net.blocks:
        block.fc = nn.Linear(2, 2)
    resolved = Policy("blocks.[0,1].fc=fp32").resolve(net)
    assert resolved == {"blocks.0.fc": Rule("fp32"), "blocks.1.fc": Rule("fp32")}


def test_qualified_names_that_start_with_nn_are_module_names() -> None:
    """torch_geometric's GINConv/NNConv keep their MLP in ``self.nn``."""

    class Conv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.nn = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.nn(x)

    policy = Policy("nn.0=fp32, nn.*=keep")
    assert policy.resolve(Conv()) == {
        "nn.0": Rule("fp32"),
        "nn.1": Rule("keep"),
        "nn.2": Rule("keep"),
    }
    assert Policy(str(policy)) == policy
    with mixprec.autocast("cpu", BF16, policy="nn.2=fp32"):
        assert Conv()(torch.randn(3, 4)).dtype == torch.float32
    assert Policy(modules={"nn.0": "fp32"}) == Policy("nn.0=fp32")


def test_a_misspelt_torch_class_is_still_refused() -> None:
    with pytest.raises(ConfigError, match=r"nn\.LayerNom.*did you mean nn\.LayerNorm"):
        Policy("nn.LayerNom=fp32")


def test_a_module_instance_as_key_says_what_to_write() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(
        ConfigError, match=r"nn\.Module instance \(Linear\).*qualified name.*nn\.Linear"
    ):
        Policy(modules={model[0]: "fp32"})
