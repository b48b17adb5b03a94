"""The advice carried to torchao.float8 and torchtitan (issue 40, item 7).

torchao's own ``convert_to_float8_training`` runs on the exported arguments on the CPU (the
conversion swaps modules; no fp8 kernel runs); what it converted is compared with the advice:
every module the advice puts in a recipe torchao.float8 has is a ``Float8Linear`` with that
recipe's ``Float8LinearConfig``, every other one is untouched, and each ruled module is either
converted or listed in ``not_expressible``. torchtitan's own ``Float8LinearConverter`` is built
from the exported config and its filter asked about every Linear.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec._src.advisor.report.export import TORCHAO_RECIPES
from mixprec._src.autocast.rules import Rule
from mixprec.errors import ConfigError

pytest.importorskip("torchao.float8", reason="torchao is the export's target (test extra)")
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear

WORDS = [
    "fp8",
    "fp8:rowwise",
    "fp8:rowwise_gw_hp",
    "mxfp8",
    "nvfp4",
    "fp8:blockwise",
    "nvfp4/nvfp4/bf16",
    "fp8/fp8/bf16",
    "bf16",  # kept
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(128, 128),
        nn.Tanh(),
        nn.Linear(128, 128),
        nn.Tanh(),
        nn.Linear(128, 128),
        nn.Tanh(),
        nn.Linear(128, 40),  # 40 outputs: not a multiple of 16
    )


def _advice() -> mixprec.types.Advice:
    model = _model()
    batch = (torch.randn(32, 128), torch.randn(32, 40))

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.mse_loss(m(b[0]), b[1])

    return mixprec.advise(model, batch, loss_fn, candidates=["fp8"], per_matmul=False)


ADVICE = _advice()


def _with_choices(words: list[str]) -> mixprec.types.Advice:
    """The advice with each module's choice replaced (the export reads the choices)."""
    rows = tuple(
        dataclasses.replace(m, choice=w) for m, w in zip(ADVICE.modules, words, strict=True)
    )
    return dataclasses.replace(ADVICE, modules=rows, kept_precision="bf16")


@settings(max_examples=25, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), min_size=4, max_size=4))
def test_torchao_converts_exactly_what_it_can_express(words: list[str]) -> None:
    advice = _with_choices(words)
    model = _model()
    export = advice.to_torchao(model)
    export.apply(model)
    modules = dict(model.named_modules())
    listed = {name for name, _, _ in export.not_expressible}
    for row in advice.modules:
        module = modules[row.name]
        rule = Rule(row.choice)
        if isinstance(module, Float8Linear):
            recipe = TORCHAO_RECIPES[rule.recipe or ""]
            assert module.config == Float8LinearConfig.from_recipe_name(recipe), row.name
            assert row.name not in listed
        elif rule.recipe is not None:  # ruled, not converted: said why
            assert row.name in listed, (row.name, row.choice)
        else:  # kept in 16-bit: neither
            assert row.name not in listed
    ruled = {r.name for r in advice.modules if Rule(r.choice).recipe is not None}
    converted = {n for n, m in modules.items() if isinstance(m, Float8Linear)}
    assert converted | listed == ruled and not converted & listed


def test_the_advice_as_measured_converts_every_linear_torchao_can_run() -> None:
    model = _model()
    export = ADVICE.to_torchao(model)
    export.apply(model)
    converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert converted == ["0", "2", "4"]  # "6" has 40 outputs
    assert [n for n, _, why in export.not_expressible if "16" in why] == ["6"]


def test_a_model_without_the_advised_modules_is_refused() -> None:
    with pytest.raises(ConfigError, match="pass the model that was advised"):
        ADVICE.to_torchao(nn.Sequential(nn.Linear(4, 4)))


def _titan() -> Any:
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed (test extra): nothing to export to")
    from tests.torchtitan_trainer import stand_in_triton

    stand_in_triton()
    from torchtitan.components.quantization.float8 import Float8LinearConverter

    from mixprec.integrations.torchtitan import MixprecConverter

    return Float8LinearConverter, MixprecConverter


@pytest.mark.parametrize(
    "words",
    [
        ["fp8:rowwise", "fp8:rowwise", "bf16", "bf16"],
        ["fp8:rowwise_gw_hp", "bf16", "fp8:rowwise_gw_hp", "bf16"],
        ["fp8:rowwise", "fp8:rowwise_gw_hp", "bf16", "bf16"],
        ["fp8", "fp8", "bf16", "bf16"],
        ["mxfp8", "fp8:rowwise", "bf16", "bf16"],
    ],
)
def test_torchtitans_converters_take_the_exported_configs(words: list[str]) -> None:
    float8_converter, mixprec_converter = _titan()
    advice = _with_choices(words)
    model = _model()
    export = advice.to_torchtitan(model)
    converter = mixprec_converter(mixprec_converter.Config(**export.mixprec))
    assert mixprec.Policy(converter.config.policy) == advice.policy
    ao = advice.to_torchao(model)
    if export.float8 is None:
        assert export.not_expressible  # says why
        return
    assert len(ao.conversions) == 1 and not ao.not_expressible
    titan = float8_converter(float8_converter.Config(**export.float8, emulate=True))
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    accepted = [n for n, m in linears if titan.filter_fn(m, n)]
    assert accepted == list(ao.conversions[0].modules)
    # emulate=True (no GPU here) makes torchtitan 0.3 drop the recipe for a tensorwise config;
    # on a GPU it builds the recipe's config from recipe_name, the same as torchao's
    assert titan.torchao_config == Float8LinearConfig(emulate=True)
    recipe = Float8LinearConfig.from_recipe_name(export.float8["recipe_name"])
    assert recipe == ao.conversions[0].config()


def test_docstring_examples_run() -> None:
    import doctest

    from mixprec._src.advisor.report import advice

    result = doctest.testmod(advice)
    assert result.failed == 0 and result.attempted >= 1
