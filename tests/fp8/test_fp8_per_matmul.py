"""Rules per matmul (``"mxfp8/mxfp8/nvfp4"``: fprop/dgrad/wgrad): every combination of formats
runs each of a Linear's three matmuls as the oracle here writes it with the recipes' own cast
functions (``quantize``/``dequantize`` per operand, an fp32 matmul, the result in the region's
dtype; a high-precision part: torch's matmul in its dtype, as autocast runs it), bit for bit,
eager and compiled; the text round-trips; on a GPU that runs some of the parts in hardware and
not the others the rule is refused by name, and ``matmul_path`` answers per matmul.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec import Policy, Rule
from mixprec._src.devices import DeviceCaps
from mixprec._src.fp8 import matmul as fp8_matmul
from mixprec._src.fp8.casts import dequantize, quantize
from mixprec._src.fp8.recipes import HIGH, MATMULS, RECIPES, Recipe, get_recipe
from mixprec.errors import ConfigError

BF16 = torch.bfloat16
D = 128  # every recipe's blocks tile it
TOKENS = 40  # not a multiple of any token block: the grad_weight matmul pads them
PARTS = [*RECIPES, *HIGH]  # the registry's recipes and the high-precision dtypes
WORDS = {"tensorwise": "fp8", **{r: f"fp8:{r}" for r in ("rowwise", "rowwise_gw_hp", "blockwise")}}


def word(part: str) -> str:
    """A part as a rule writes it."""
    return WORDS.get(part, part)


def triples() -> list[tuple[str, str, str]]:
    """Every combination with a low-precision matmul (all-high triples are a dtype rule)."""
    out = []
    for t in itertools.product(PARTS, repeat=3):
        low = [i for i, p in enumerate(t) if p in RECIPES and RECIPES[p].pairs[i][0] is not None]
        if low:
            out.append(t)
    return out


# ---------------------------------------------------------------- the oracle
def _deq(t: torch.Tensor, cast: Any, dim: int) -> torch.Tensor:
    return dequantize(quantize(t, cast, dim)[0], cast)


def _product(
    part: str,
    i: int,
    operands: tuple[torch.Tensor, torch.Tensor],
    dims: tuple[int, int],
    hp: torch.dtype,
    op: Any,
) -> torch.Tensor:
    """Matmul ``i`` (``op`` of its operands, as they are stored, contracting along ``dims``) as
    ``part`` runs it: on the operands cast by the registry recipe's casts for that matmul, in
    fp32, the result in ``hp``; or autocast's matmul in the part's dtype (a recipe's own
    high-precision matmul: the region's)."""
    a, b = operands
    recipe = RECIPES.get(part)
    pair = recipe.pairs[i] if recipe is not None else (None, None)
    if pair[0] is None:
        dtype = HIGH.get(part, hp)
        return op(a.to(dtype), b.to(dtype)).to(hp)
    ca, cb = pair
    return op(_deq(a, ca, dims[0]), _deq(b, cb, dims[1])).to(hp)


def _pad(t: torch.Tensor, parts: tuple[str, ...]) -> torch.Tensor:
    """The tokens zero-padded to the blocks the grad_weight part's casts run along them."""
    recipe = RECIPES.get(parts[2])
    multiple = 1 if recipe is None else recipe.multiples()[0]
    return F.pad(t, (0, 0, 0, -t.shape[0] % multiple))


def oracle(
    parts: tuple[str, ...], x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, hp: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """(output, grad_input, grad_weight) of ``x @ w.T`` with each matmul in its part; the
    stochastic casts draw in the order the recipe runs them (grad_input's, then grad_weight's)."""
    xdtype, x, dy = x.dtype, x.to(hp), dy.to(hp)
    out = _product(parts[0], 0, (x, w), (1, 1), hp, lambda a, b: a @ b.t())
    torch.manual_seed(1)
    dx = _product(parts[1], 1, (dy, w), (1, 0), hp, lambda a, b: a @ b)
    gw = (_pad(dy, parts), _pad(x, parts))
    dw = _product(parts[2], 2, gw, (0, 0), hp, lambda a, b: a.t() @ b)
    return out, dx.to(xdtype), dw.to(w.dtype)


def run(rule: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, compiled: bool = False):
    lin = nn.Linear(D, D, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    model = nn.Sequential(lin)
    fn = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    xx = x.clone().requires_grad_(True)
    with mixprec.autocast("cpu", BF16, policy=Policy(modules={"0": rule})):
        out = fn(xx)
    torch.manual_seed(1)
    out.backward(dy.to(out.dtype))
    return out.detach(), xx.grad, lin.weight.grad


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, D, generator=gen)
    w = torch.randn(D, D, generator=gen) / D**0.5
    dy = torch.randn(TOKENS, D, generator=gen)
    return x, w, dy


def _same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], label: str) -> None:
    for name, g, e in zip(("output", "grad_input", "grad_weight"), got, want, strict=True):
        assert g.dtype == e.dtype, f"{label}: {name} dtype {g.dtype} != {e.dtype}"
        assert torch.equal(g, e.to(g.dtype)), f"{label}: {name} differs from the oracle"


# ---------------------------------------------------------------- the tests
def test_every_combination_is_each_matmul_in_its_part_eager() -> None:
    x, w, dy = _inputs()
    cases = triples()
    assert len(cases) > 400  # every registry recipe and dtype at every matmul
    for parts in cases:
        rule = "/".join(word(p) for p in parts)
        _same(run(rule, x, w, dy), oracle(parts, x, w, dy, BF16), rule)


@pytest.mark.parametrize(
    "parts",
    [
        ("mxfp8", "mxfp8", "nvfp4"),
        ("bf16", "tensorwise", "tensorwise"),
        ("nvfp4", "nvfp4", "fp32"),
        ("rowwise", "blockwise", "rowwise_gw_hp"),
        ("fp32", "nvfp4", "mxfp8"),
    ],
    ids="/".join,
)
def test_combinations_compiled_are_the_oracle(parts: tuple[str, ...]) -> None:
    torch._dynamo.reset()
    x, w, dy = _inputs(1)
    rule = "/".join(word(p) for p in parts)
    _same(run(rule, x, w, dy, compiled=True), oracle(parts, x, w, dy, BF16), rule)


def test_three_equal_parts_are_the_recipe_itself() -> None:
    for name in RECIPES:
        w = word(name)
        assert Rule(f"{w}/{w}/{w}") == Rule(w)
        assert get_recipe(f"{name}/{name}/{name}") is RECIPES[name]


@settings(max_examples=60, deadline=None)
@given(
    st.tuples(*[st.sampled_from([*PARTS, "fp8", "float32", "bfloat16"])] * 3),
    st.sampled_from(["", "@fp32", "@input"]),
    st.sampled_from([" ", ""]),
)
def test_the_text_round_trips_through_str_and_a_policy(
    parts: tuple[str, ...], output: str, space: str
) -> None:
    text = (space + "/" + space).join(word(p) for p in parts) + output
    try:
        rule = Rule(text)
    except ConfigError as err:  # only a triple without a low-precision matmul is refused
        assert "no matmul in low precision" in str(err)
        return
    assert Rule(str(rule)) == rule and hash(Rule(str(rule))) == hash(rule)
    policy = Policy(f"blocks.*.fc={rule}, nn.Linear=mxfp8")
    assert Policy(str(policy)) == policy
    assert rule.matmuls is not None and len(rule.matmuls) == 3
    assert get_recipe(rule.recipe or "").name == rule.recipe


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("mxfp8/bf16", "names 3 formats"),
        ("mxfp8/mxfp8/nvfp4/bf16", "names 3 formats"),
        ("bf16/bf16/fp32", "no matmul in low precision"),
        ("keep/fp8/fp8", "fprop part 'keep'"),
        ("fp8/low/fp8", "dgrad part 'low'"),
        ("nvfp4/nvfp4/nvfp4:x", "unknown recipe 'x' for 'nvfp4'"),
    ],
)
def test_a_bad_rule_per_matmul_names_the_part(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Rule(text)


def test_a_rule_per_matmul_is_a_module_rule_only() -> None:
    with pytest.raises(ConfigError, match="accepted for ops"):
        Policy("F.linear=mxfp8/mxfp8/nvfp4")
    with pytest.raises(ConfigError, match="takes no recipe"):
        Rule("mxfp8/mxfp8/nvfp4", recipe="mxfp8")


def test_with_matmuls_replaces_the_parts_given() -> None:
    rule = Rule("nvfp4@fp32")
    assert rule.with_matmuls(fprop="bf16") == Rule("bf16/nvfp4/nvfp4@fp32")
    assert rule.with_matmuls(fprop="bf16").with_matmuls(fprop="nvfp4") == rule
    with pytest.raises(ConfigError, match="not a low-precision recipe"):
        Rule("bf16").with_matmuls(fprop="fp32")


# ---------------------------------------------------------------- the hardware path
def _gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> torch.device:
    """The CPU seen as a CUDA GPU of ``capability`` with fast scaled matmuls (the path's
    decision only: nothing is run)."""
    row = DeviceCaps(fp8_scaled_mm=True, block_scaled_mm=True)
    monkeypatch.setattr(fp8_matmul, "caps", lambda device: row)
    monkeypatch.setattr(fp8_matmul, "_capability", lambda device: capability)
    return torch.device("cpu")


@pytest.mark.parametrize(
    ("capability", "rule", "paths"),
    [
        ((10, 0), "mxfp8/mxfp8/nvfp4", ("hardware", "hardware", "hardware")),
        ((9, 0), "bf16/fp8:rowwise/fp8", ("high precision", "hardware", "hardware")),
        ((9, 0), "mxfp8/mxfp8/nvfp4", ("emulated", "emulated", "emulated")),
        ((8, 0), "fp8/fp8/bf16", ("emulated", "emulated", "high precision")),
    ],
)
def test_matmul_path_answers_per_matmul(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], rule: str, paths: tuple[str, ...]
) -> None:
    device = _gpu(monkeypatch, capability)
    assert tuple(mixprec.matmul_path(rule, device, m) for m in MATMULS) == paths
    low = {p for p in paths if p != "high precision"}
    assert mixprec.matmul_path(rule, device) == low.pop()


@pytest.mark.parametrize(
    ("capability", "rule", "off"),
    [
        ((9, 0), "fp8:rowwise/fp8:rowwise/nvfp4", "wgrad (nvfp4: compute capability 10.0"),
        ((10, 0), "fp8:blockwise/mxfp8/mxfp8", "fprop (blockwise: compute capability 9.0"),
    ],
)
def test_a_mix_the_gpu_half_runs_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], rule: str, off: str
) -> None:
    device = _gpu(monkeypatch, capability)
    with pytest.raises(ConfigError, match=r"cannot run on") as err:
        mixprec.matmul_path(rule, device)
    assert off in str(err.value)
    model = nn.Sequential(nn.Linear(D, D))
    region = mixprec.autocast("cpu", BF16, policy=Policy(modules={"0": rule}))
    with pytest.raises(ConfigError, match=r"cannot run on"), region:  # the forward refuses too
        model(torch.randn(16, D))


def test_matmul_path_refuses_a_bad_matmul() -> None:
    with pytest.raises(ConfigError, match="fprop, dgrad, wgrad"):
        mixprec.matmul_path("mxfp8", "cpu", "forward")


def test_the_recipe_records_its_sources() -> None:
    recipe = get_recipe("bf16/mxfp8/nvfp4")
    assert isinstance(recipe, Recipe) and recipe.parts == ("bf16", "mxfp8", "nvfp4")
    assert [s and s.name for s in recipe.sources] == [None, "mxfp8", "nvfp4"]
    # A registry recipe's own high-precision matmul has no source.
    assert RECIPES["rowwise_gw_hp"].sources[2] is None


@pytest.mark.parametrize("rule", ["fp8", "bf16/fp8/fp8", "fp32/mxfp8/nvfp4", "mxfp8/mxfp8/bf16"])
def test_fp8_stats_count_every_operand_s_inf_and_nan_once(rule: str) -> None:
    """An inf in the input and a NaN in the weight are counted once each, whichever matmul
    casts the operand first (the forward's in high precision: the backward's casts count)."""
    lin = nn.Linear(D, D, bias=False)
    with torch.no_grad():
        lin.weight[3, 5] = float("nan")
    x = torch.randn(TOKENS, D)
    x[1, 2] = float("inf")
    stats = mixprec.Fp8Stats()
    with stats, mixprec.autocast("cpu", BF16, policy=Policy(modules={"0": rule})):
        out = nn.Sequential(lin)(x.requires_grad_(True))
    out.float().sum().backward()
    found = stats.read()["0"]
    assert found.input.nonfinite == 1 and found.weight.nonfinite == 1, rule
