"""The advisor on a real client's patterns (nanoGPT's model.py: its own LayerNorm class, tied
lm_head/wte, a ModuleList of blocks, an nn.MultiheadAttention variant) and its guarantees:
arguments checked before any pass, 16-bit models refused up front, loss functions of another
form named, training flags restored."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.advisor_models import BiasLayerNorm, nano_task
from torch import nn

import mixprec
from mixprec.errors import ConfigError


@pytest.fixture(scope="module")
def nano_fp8() -> mixprec.types.Advice:
    model, batch, loss_fn = nano_task()
    return mixprec.advise(model, batch, loss_fn, candidates=["fp8"], keep_at_most=2, check=True)


def test_norms_no_candidate_serves_are_not_kept_and_do_not_use_up_keep_at_most(
    nano_fp8: mixprec.types.Advice,
) -> None:
    norms = [m for m in nano_fp8.modules if m.kind == "BiasLayerNorm"]
    assert len(norms) == 5 and all(not m.served and m.measurements == () for m in norms)
    assert not set(nano_fp8.kept) & {m.name for m in norms}
    assert len(nano_fp8.kept) == 2 and "lm_head" in nano_fp8.kept  # the two most sensitive
    assert nano_fp8.met
    assert not any("inf/NaN" in n for n in nano_fp8.notes)
    assert any("get no rule (BiasLayerNorm x5" in n for n in nano_fp8.notes)
    assert all(
        "no candidate serves BiasLayerNorm (fp8 serves 2D weights" in m.reason for m in norms
    )
    for norm in norms:  # no rule: the region runs them
        assert nano_fp8.policy.module_rule(nn.LayerNorm(4), norm.name) is None
    assert nano_fp8.measured_sqnr is not None
    assert abs(nano_fp8.measured_sqnr - nano_fp8.predicted_sqnr) <= 0.5


def test_keeping_two_beats_all_fp8(nano_fp8: mixprec.types.Advice) -> None:
    impact = [m.measurement("fp8") for m in nano_fp8.modules if m.served]
    noise = 10 ** (-nano_fp8.region_sqnr / 10) + sum(
        10 ** (-x.model_grad_sqnr / 10) for x in impact if x is not None
    )
    assert nano_fp8.predicted_sqnr > -10 * math.log10(noise) + 1.0


def test_tied_head_is_measured_once_with_the_shared_weight() -> None:
    model, batch, loss_fn = nano_task()
    assert model.lm_head.weight is model.transformer.wte.weight
    advice = mixprec.advise(model, batch, loss_fn, candidates=["bf16"], keep_at_most=1)
    head = next(m for m in advice.modules if m.name == "lm_head")
    assert head.params == model.lm_head.weight.numel()
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied


def test_multihead_attention_is_one_module_and_the_rest_is_measured() -> None:
    model, batch, loss_fn = nano_task(torch_attention=True)
    bf16 = mixprec.advise(model, batch, loss_fn, candidates=["bf16"])
    names = [m.name for m in bf16.modules]
    assert "transformer.h.0.attn.mha" in names
    assert not any(n.endswith("out_proj") for n in names)  # never called as a module
    fp8 = mixprec.advise(model, batch, loss_fn, candidates=["fp8"], keep_at_most=1)
    mha = next(m for m in fp8.modules if m.name == "transformer.h.0.attn.mha")
    assert not mha.served and mha.name not in fp8.kept
    assert len(fp8.kept) == 1


def test_a_parametrized_linear_is_measured() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    torch.nn.utils.parametrizations.weight_norm(model[2])
    batch = (torch.randn(32, 8), torch.randn(32, 4))
    advice = mixprec.advise(model, batch, lambda m, b: F.mse_loss(m(b[0]), b[1]), candidates="bf16")
    assert [m.name for m in advice.modules] == ["0", "2"]


# --- arguments checked before the first pass ---------------------------------------------------


def _counting_loss() -> tuple[list[int], Any]:
    calls: list[int] = []

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        calls.append(1)
        return F.mse_loss(m(b[0]), b[1])

    return calls, loss_fn


def _mlp() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, (torch.randn(32, 8), torch.randn(32, 4))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"more_batches": 5}, "more_batches must be a list or tuple.*int 5"),
        ({"more_batches": torch.zeros(2)}, "more_batches must be a list or tuple.*Tensor"),
        ({"progress": 5}, "progress must be None or a function.*int 5"),
        ({"candidates": ["fp8"], "modules": ["1"]}, "serves nn.Linear"),
        ({"candidates": ["mxfp8"]}, "in_features 8 is not a multiple of mxfp8's block 32"),
        ({"gpu": "a100"}, "not a GPU"),
    ],
)
def test_bad_arguments_fail_before_the_first_pass(kwargs: dict[str, Any], match: str) -> None:
    model, batch = _mlp()
    calls, loss_fn = _counting_loss()
    with pytest.raises(ConfigError, match=match):
        mixprec.advise(model, batch, loss_fn, **kwargs)
    assert calls == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_model_is_refused_up_front_naming_the_fix(dtype: torch.dtype) -> None:
    model, batch = _mlp()
    model = model.to(dtype)
    calls, loss_fn = _counting_loss()
    with pytest.raises(ConfigError, match=r"float32 copy \(copy.deepcopy\(model\).float\(\)"):
        mixprec.advise(model, batch, loss_fn)
    assert calls == []


def test_a_bf16_buffer_is_refused_too() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_mean = model[1].running_mean.bfloat16()
    with pytest.raises(ConfigError, match=r"'1\.running_mean'"):
        mixprec.advise(model, torch.randn(8, 4), lambda m, b: m(b).sum())


@pytest.mark.parametrize(
    ("loss_fn", "match"),
    [
        (F.mse_loss, r"raised AttributeError.*before calling the model.*loss_fn\(model, batch\)"),
        (lambda output, target: F.mse_loss(output, target), "before calling the model"),
        (lambda model: model(torch.randn(2, 8)).sum(), r"cannot be called with \(model, batch\)"),
        (lambda model, batch, extra: 0, r"cannot be called with \(model, batch\)"),
    ],
)
def test_loss_functions_of_another_form_are_named(loss_fn: Any, match: str) -> None:
    model, batch = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=match):
        mixprec.advise(model, batch, loss_fn)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_an_error_inside_the_model_is_the_users_own() -> None:
    model, batch = _mlp()

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return m(b[0][:, :3]).sum()  # a shape bug in the user's code

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        mixprec.advise(model, batch, loss_fn)


def test_training_flags_are_restored_after_a_loss_function_that_calls_train() -> None:
    model, batch = _mlp()
    model.eval()
    model[2].train()  # a mixed state

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        m.train()
        return F.mse_loss(m(b[0]), b[1])

    mixprec.advise(model, batch, loss_fn, candidates=["bf16"])
    assert [m.training for m in model.modules()] == [False, False, False, True]


def test_every_pass_starts_in_the_callers_mode() -> None:
    """A loss function that switches to eval after its forward: every pass still starts in
    train mode (dropout active in each), so the bf16 figures stay those of rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    batch = (torch.randn(64, 8), torch.randn(64, 4))

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        loss = F.mse_loss(m(b[0]), b[1])
        m.eval()
        return loss

    advice = mixprec.advise(copy.deepcopy(model), batch, loss_fn, candidates=["bf16"])
    assert min(m.measurements[0].model_grad_sqnr for m in advice.modules) > 30


def test_bias_layernorm_is_selected_by_default_for_16_bit_candidates() -> None:
    model, batch, loss_fn = nano_task()
    advice = mixprec.advise(model, batch, loss_fn, candidates=["bf16"])
    norms = [m for m in advice.modules if m.kind == BiasLayerNorm.__name__]
    assert len(norms) == 5 and all(m.measurements for m in norms)
    for m in norms:  # measured, exact in bf16 (autocast runs a norm's ops in float32): no rule
        assert m.measurements[0].model_grad_sqnr == math.inf
        assert not m.served and m.choice == "bf16" and "no matmul" in m.reason
        assert advice.policy.module_rule(BiasLayerNorm(4), m.name) is None
    assert not set(advice.kept) & {m.name for m in norms}


# --- the additive model's own check ------------------------------------------------------------


def test_the_cheapest_policy_is_measured_and_says_where_the_prediction_fails() -> None:
    """A BatchNorm CNN in fp16: the additive prediction is pessimistic by several dB (measured
    on this model and batch); the report says so, and check=True reuses that pass."""
    from tests.advisor_models import bn_cnn_task

    model, batch, loss_fn = bn_cnn_task()
    advice = mixprec.advise(model, batch, loss_fn, candidates=["fp16"], check=True)
    cheapest = advice.cheapest
    assert cheapest is not None and str(cheapest.policy) == str(advice.policy) == ""
    assert advice.measured_sqnr == cheapest.measured  # the same pass
    assert advice.passes == 1 + 5 + 1 + 1
    assert cheapest.error > 3.0
    text = " ".join(advice.table().split())
    assert "pessimistic by" in text and "trust check=True" in text


def test_where_the_prediction_holds_the_report_says_so(nano_fp8: mixprec.types.Advice) -> None:
    cheapest = nano_fp8.cheapest
    assert cheapest is not None and str(cheapest.policy) == "nn.Linear=fp8"
    assert abs(cheapest.error) < 1.0
    assert "the prediction holds here" in " ".join(nano_fp8.table().split())
