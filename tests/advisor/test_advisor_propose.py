"""The proposal's search and policy writer, property-based against brute force."""

from __future__ import annotations

import fnmatch
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mixprec import Policy
from mixprec._src.advisor.choose.policy import build_policy
from mixprec._src.advisor.choose.search import Choice, Option, Target, search
from mixprec._src.advisor.measure.metrics import db_to_ratio, ratio_to_db
from mixprec.errors import ConfigError

SETTINGS = settings(max_examples=80, deadline=None)
dbs = st.one_of(st.floats(min_value=10.0, max_value=90.0), st.just(-math.inf))


def _choices(values: list[float]) -> list[Choice]:
    return [
        Choice(f"m{i}", [Option("fp8", db_to_ratio(db), db), Option("bf16", 0.0, math.inf)])
        for i, db in enumerate(values)
    ]


def _predicted(region: float, ratios: list[float]) -> float:
    return ratio_to_db(region + sum(ratios))


@SETTINGS
@given(
    values=st.lists(dbs, min_size=1, max_size=7),
    region_db=st.floats(min_value=20.0, max_value=80.0),
    target=st.floats(min_value=15.0, max_value=60.0),
)
def test_one_candidate_keeps_the_fewest_modules_that_reach_the_target(
    values: list[float], region_db: float, target: float
) -> None:
    region = db_to_ratio(region_db)
    result = search(_choices(values), region, Target(target, None))
    kept = {c.name for c in result.choices if c.kept}
    ratios = [db_to_ratio(v) for v in values]
    reachable = [
        k
        for k in range(len(values) + 1)
        for subset in itertools.combinations(range(len(values)), k)
        if _predicted(region, [r for i, r in enumerate(ratios) if i not in subset]) >= target
    ]
    assert result.met == bool(reachable)
    if reachable:
        assert len(kept) == min(reachable)
    assert result.predicted == _predicted(region, [c.current.ratio for c in result.choices])
    assert all(not math.isinf(c.current.ratio) for c in result.choices)  # inf/NaN is kept
    assert {f"m{i}" for i, v in enumerate(values) if v == -math.inf} <= kept


@SETTINGS
@given(values=st.lists(dbs, min_size=1, max_size=7), k=st.integers(0, 8))
def test_keep_at_most_alone_keeps_the_k_most_sensitive(values: list[float], k: int) -> None:
    result = search(_choices(values), 0.0, Target(None, k))
    kept = [int(c.name[1:]) for c in result.choices if c.kept]
    forced = [i for i, v in enumerate(values) if v == -math.inf]
    expected = max(len(forced), min(k, len(values)))
    assert len(kept) == expected
    assert result.met == (len(forced) <= k)
    worst_left = max(
        (db_to_ratio(values[i]) for i in range(len(values)) if i not in kept), default=0
    )
    assert all(db_to_ratio(values[i]) >= worst_left for i in kept)


@SETTINGS
@given(
    values=st.lists(st.floats(min_value=10.0, max_value=90.0), min_size=1, max_size=6),
    target=st.floats(min_value=15.0, max_value=60.0),
    k=st.integers(0, 6),
)
def test_a_met_target_is_predicted_and_within_the_limit(
    values: list[float], target: float, k: int
) -> None:
    result = search(_choices(values), 0.0, Target(target, k))
    kept = sum(c.kept for c in result.choices)
    assert kept <= k
    assert result.met == (result.predicted >= target)
    if not result.met:
        assert result.notes and "not met" in result.notes[0]
        assert kept == min(k, len(values))  # it used every module it was allowed to keep


@SETTINGS
@given(
    pairs=st.lists(
        st.tuples(
            st.floats(min_value=20.0, max_value=60.0), st.floats(min_value=0.0, max_value=20.0)
        ),
        min_size=1,
        max_size=5,
    ),
    target=st.floats(min_value=20.0, max_value=60.0),
    k=st.one_of(st.none(), st.integers(0, 5)),
)
def test_two_candidates_keep_the_fewest_modules_of_any_assignment(
    pairs: list[tuple[float, float]], target: float, k: int | None
) -> None:
    """Each module: a cheap candidate, a better one (its SQNR plus a gain), or kept. Against
    brute force over every assignment: the target is met exactly when some assignment meets it
    within the limit, and then with the fewest kept modules of any such assignment."""
    choices = [
        Choice(
            f"m{i}",
            [
                Option("fp8", db_to_ratio(db), db),
                Option("fp8:rowwise", db_to_ratio(db + gain), db + gain),
                Option("bf16", 0.0, math.inf),
            ],
        )
        for i, (db, gain) in enumerate(pairs)
    ]
    result = search(choices, db_to_ratio(70.0), Target(target, k))
    limit = len(pairs) if k is None else k
    feasible = [
        sum(a == 2 for a in assign)
        for assign in itertools.product(range(3), repeat=len(pairs))
        if sum(a == 2 for a in assign) <= limit
        and _predicted(
            db_to_ratio(70.0), [c.options[a].ratio for c, a in zip(choices, assign, strict=True)]
        )
        >= target
    ]
    assert result.met == bool(feasible)
    if feasible:
        assert sum(c.kept for c in result.choices) == min(feasible)
        assert result.predicted >= target


def test_an_intermediate_candidate_is_used_before_keeping() -> None:
    """fp8 -> bf16 -> fp32: a module moves one step at a time, and an option that is worse than
    the current one (bf16 after fp16) is skipped."""
    c = Choice(
        "m", [Option("fp8", 1e-3, 30.0), Option("bf16", 1e-5, 50.0), Option("fp32", 0, math.inf)]
    )
    result = search([c], 0.0, Target(40.0, None))
    assert result.choices[0].current.word == "bf16" and result.met
    d = Choice(
        "m", [Option("fp16", 1e-7, 70.0), Option("bf16", 1e-5, 50.0), Option("fp32", 0, math.inf)]
    )
    result = search([d], 0.0, Target(80.0, None))
    assert result.choices[0].kept and result.met


def test_unreachable_region_is_explained() -> None:
    result = search(_choices([40.0]), db_to_ratio(25.0), Target(30.0, None))
    assert not result.met and "out of reach" in result.notes[0]


# ------------------------------------------------------------------ build_policy
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.conv = nn.Conv1d(2, 2, 1)
        self.act = nn.Tanh()


def _model(blocks: int) -> nn.Module:
    model = nn.Module()
    model.blocks = nn.ModuleList(Block() for _ in range(blocks))
    model.head = nn.Linear(2, 2)
    return model


WORDS = ("fp16", "bf16", "fp32")


@SETTINGS
@given(
    blocks=st.integers(1, 4),
    data=st.data(),
    region=st.sampled_from(("fp16", "bf16")),
)
def test_policy_gives_each_module_its_choice_and_round_trips(
    blocks: int, data: st.DataObject, region: str
) -> None:
    model = _model(blocks)
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv1d))]
    measured = data.draw(st.lists(st.sampled_from(names), unique=True, min_size=1))
    measured = [n for n in names if n in measured]
    choices = {n: data.draw(st.sampled_from(WORDS)) for n in measured}
    policy = build_policy(model, choices, region, measured)
    assert Policy(str(policy)) == policy
    modules = dict(model.named_modules())
    for name, module in modules.items():
        rule = policy.module_rule(module, name)
        got = region if rule is None else str(rule)
        want = choices.get(name, region)
        assert got == want, (name, str(policy))


def test_class_rule_with_exceptions_when_most_modules_share_a_rule() -> None:
    model = _model(3)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    choices = dict.fromkeys(names, "fp16") | {"head": "fp32"}
    assert str(build_policy(model, choices, "bf16", names)) == "nn.Linear=fp16, head=fp32"
    # not every Linear measured: name rules only (a class rule would reach unmeasured ones)
    policy = build_policy(model, {n: "fp16" for n in names[:2]}, "bf16", names[:2])
    assert str(policy) == "blocks.0.fc=fp16, blocks.1.fc=fp16"


@pytest.mark.parametrize("name", ["a,b", "a;b", "a[b"])
def test_a_name_with_the_policy_syntax_in_it_round_trips(name: str) -> None:
    model = nn.Module()
    model.add_module(name, nn.Linear(2, 2))
    model.add_module("ab", nn.Linear(2, 2))
    policy = build_policy(model, {name: "fp32", "ab": "fp16"}, "fp16", [name, "ab"])
    assert Policy(str(policy)) == policy
    modules = dict(model.named_modules())
    assert str(policy.module_rule(modules[name], name)) == "fp32"
    assert policy.module_rule(modules["ab"], "ab") is None


def test_glob_characters_in_names_are_escaped() -> None:
    model = nn.Module()
    for name in ("a*", "ab", "a?", "a[0]"):
        model.add_module(name, nn.Linear(2, 2))
    policy = build_policy(model, {"a*": "fp32", "a[0]": "fp32"}, "fp16", ["a*", "a[0]"])
    assert Policy(str(policy)) == policy
    modules = dict(model.named_modules())
    got = {n: str(policy.module_rule(modules[n], n)) for n in ("a*", "ab", "a?", "a[0]")}
    assert got == {"a*": "fp32", "ab": "None", "a?": "None", "a[0]": "fp32"}


GLOB_CHARS = "ab.0*?[]!,;=- \n"


@settings(max_examples=300, deadline=None)
@given(
    globs=st.lists(st.text(GLOB_CHARS, min_size=1, max_size=8), min_size=1, max_size=3),
    names=st.lists(st.text("ab.0[]!,;=- \n", max_size=6), max_size=12),
)
def test_any_glob_round_trips_through_the_policy_string(globs: list[str], names: list[str]) -> None:
    """A policy of name globs (unclosed '[', commas, semicolons, newlines, classes) reads back
    from its string as an equal policy that matches exactly the names each glob matches."""
    try:
        policy = Policy(modules={g: "bf16" if i % 2 else "fp32" for i, g in enumerate(globs)})
    except ConfigError:  # a blank glob, two globs that are one, a torch name
        return
    again = Policy(str(policy))
    assert again == policy and str(again) == str(policy)
    written = [g.strip() for g in globs]
    for glob, stored in zip(dict.fromkeys(written), policy.name_rules, strict=True):
        for name in [*names, glob]:
            assert fnmatch.fnmatchcase(name, stored) == fnmatch.fnmatchcase(name, glob)
