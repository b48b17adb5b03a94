"""mixprec.advise: measurements against hand-built torch.autocast runs, the float16 target,
state left untouched, determinism, reports and errors (small models; the GPT target is in
test_advisor_gpt.py)."""

from __future__ import annotations

import copy
import json
import math
import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.advisor_models import loud_task, mse, small_task
from torch import nn

import mixprec
from mixprec.errors import ConfigError


def _sqnr(low: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    signal = sum(float((r.double() ** 2).sum()) for r in ref)
    noise = sum(
        float(((a.double() - r.double()) ** 2).sum()) for a, r in zip(low, ref, strict=True)
    )
    return -10 * math.log10(noise / signal)


def _grads(model: nn.Module, batch: Any, region: Any = None, scale: float = 1.0) -> list:
    model.zero_grad(set_to_none=True)
    if region is None:
        loss = mse(model, batch)
    else:
        with region:
            loss = mse(model, batch)
    (loss * scale).backward()
    return [p.grad.detach().clone() / scale for p in model.parameters()]


def _mlp() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )
    return model, (torch.randn(64, 16), torch.randn(64, 4))


def test_isolated_pass_matches_a_hand_built_torch_autocast_run() -> None:
    """Module '2' alone in bf16 (torch.autocast around it, output back to fp32, the rest fp32):
    the whole-model gradient and output SQNRs equal the advisor's figures."""
    model, batch = _mlp()
    advice = mixprec.advise(model, batch, mse, candidates=["bf16"])
    ref = _grads(copy.deepcopy(model), batch)
    twin = copy.deepcopy(model)
    outs: dict[str, torch.Tensor] = {}

    def pre(mod: nn.Module, args: Any) -> None:
        mod._ctx = torch.autocast("cpu", dtype=torch.bfloat16)
        mod._ctx.__enter__()

    def post(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        mod._ctx.__exit__(None, None, None)
        outs["low"] = out.detach().float()
        return out.float()

    twin[2].register_forward_pre_hook(pre)
    twin[2].register_forward_hook(post)
    low = _grads(twin, batch)
    ref_out = model[2](torch.tanh(model[0](batch[0]))).detach()
    row = next(m for m in advice.modules if m.name == "2")
    got = row.measurement("bf16")
    assert got is not None
    assert got.model_grad_sqnr == pytest.approx(_sqnr(low, ref), abs=1e-9)
    assert got.output_sqnr == pytest.approx(_sqnr([outs["low"]], [ref_out]), abs=1e-9)
    assert got.weight_grad_sqnr == pytest.approx(_sqnr(low[2:4], ref[2:4]), abs=1e-9)


def test_check_mode_measures_the_policy_under_mixprec_autocast() -> None:
    model, batch = _mlp()
    advice = mixprec.advise(model, batch, mse, candidates=["bf16"], keep_at_most=1, check=True)
    assert len(advice.kept) == 1
    worst = min(advice.modules, key=lambda m: m.measurements[0].model_grad_sqnr)
    assert advice.kept == (worst.name,)
    assert str(advice.policy) == f"{worst.name}=fp32"
    ref = _grads(copy.deepcopy(model), batch)
    region = mixprec.autocast("cpu", dtype=torch.bfloat16, policy=advice.policy)
    low = _grads(copy.deepcopy(model), batch, region)
    assert advice.measured_sqnr == pytest.approx(_sqnr(low, ref), abs=1e-9)
    assert advice.passes == 1 + 3 + 1 + 1 + 1  # reference, modules, region, cheapest, check


def _train(model: nn.Module, batch: Any, steps: int, **region: Any) -> tuple[list[float], int]:
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    init_scale = region.pop("init_scale", 65536.0)
    enabled = region.pop("enabled", True)
    scaler = mixprec.GradScaler("cpu", init_scale=init_scale, enabled=enabled)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with mixprec.autocast("cpu", enabled=enabled, **region):
            loss = mse(model, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss.detach()))
    return losses, scaler.stats().steps_skipped if enabled else 0


@pytest.mark.filterwarnings("ignore::mixprec.errors.ScaleCollapseWarning")
def test_fp16_target_names_the_loud_layer_and_its_policy_trains_like_fp32() -> None:
    model, batch, loss_fn = loud_task()
    advice = mixprec.advise(model, batch, loss_fn, candidates=["fp16"])
    assert advice.kept == ("loud.fc",)
    assert str(advice.policy) == "loud.fc=fp32"
    assert advice.dtype == torch.float16 and advice.init_scale is not None
    loud = next(m for m in advice.modules if m.name == "loud.fc")
    assert loud.fp16 is not None and loud.fp16.output_overflow > 0
    assert loud.fp16.output_max > 65504
    assert "65504" in loud.reason
    assert all(m.fp16.output_overflow == 0 for m in advice.modules if m.name != "loud.fc")

    fp32, _ = _train(model, batch, 50, enabled=False)
    proposed, skipped = _train(
        model, batch, 50, dtype=advice.dtype, policy=advice.policy, init_scale=advice.init_scale
    )
    all_fp16, skipped_fp16 = _train(model, batch, 50, dtype=torch.float16)
    assert fp32[-1] < 0.5 * fp32[0]  # it trains
    assert skipped == 0
    assert abs(proposed[-1] - fp32[-1]) <= 0.01 * fp32[-1]
    assert skipped_fp16 > 0 or not math.isfinite(all_fp16[-1])


def _state(model: nn.Module) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [p.grad for p in model.parameters()],
        "grad_values": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "buffer_ids": [id(b) for b in model.buffers()],
        "rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "hooks": [
            (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for m in model.modules()
        ],
        "attrs": [sorted(m.__dict__) for m in model.modules()],
        "training": [m.training for m in model.modules()],
    }


def _assert_same_state(before: dict[str, Any], model: nn.Module) -> None:
    after = _state(model)
    assert all(torch.equal(a, b) for a, b in zip(before["params"], after["params"], strict=True))
    assert all(a is b for a, b in zip(before["grads"], after["grads"], strict=True))
    for a, b in zip(before["grad_values"], after["grad_values"], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(before["buffers"], after["buffers"], strict=True))
    assert before["buffer_ids"] == after["buffer_ids"]
    assert torch.equal(before["rng"], after["rng"])
    for key in ("py_rng", "hooks", "attrs", "training"):
        assert before[key] == after[key], key


def _prepared_small() -> tuple[nn.Module, Any, Any]:
    model, batch, loss_fn = small_task()
    loss_fn(model, batch).backward()  # the user's own gradients, kept for them
    model.out.weight.grad = None  # one parameter without a gradient
    return model, batch, loss_fn


def test_parameters_buffers_grads_rng_and_hooks_are_left_as_they_were() -> None:
    model, batch, loss_fn = _prepared_small()
    before = _state(model)
    mixprec.advise(model, batch, loss_fn, candidates=["fp16", "bf16"], keep_at_most=1, check=True)
    _assert_same_state(before, model)


def test_state_is_restored_when_the_loss_function_raises_midway() -> None:
    model, batch, loss_fn = _prepared_small()
    before = _state(model)
    calls = []

    def flaky(m: nn.Module, b: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("data loader broke")
        return loss_fn(m, b)

    with pytest.raises(RuntimeError, match="data loader broke"):
        mixprec.advise(model, batch, flaky, candidates=["bf16"])
    _assert_same_state(before, model)


def test_same_inputs_give_the_same_report() -> None:
    model, batch, loss_fn = small_task()
    kwargs: dict[str, Any] = {"candidates": ["fp16", "bf16"], "min_sqnr": 80.0}
    first = mixprec.advise(model, batch, loss_fn, **kwargs)
    second = mixprec.advise(model, batch, loss_fn, **kwargs)
    assert first == second
    assert first.to_json() == second.to_json()


def test_dropout_sees_the_same_masks_in_every_pass() -> None:
    """With the RNG reset before every pass, a bf16 pass of a dropout model differs from the
    reference only by rounding: no module looks worse than 30 dB."""
    model, batch, loss_fn = small_task()
    advice = mixprec.advise(model, batch, loss_fn, candidates=["bf16"])
    assert min(m.measurements[0].model_grad_sqnr for m in advice.modules) > 30


def test_several_batches_and_a_module_called_twice() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(8, 2))
    batches = [(torch.randn(16, 8), torch.randn(16, 2)) for _ in range(3)]
    advice = mixprec.advise(model, batches[0], mse, candidates=["bf16"], more_batches=batches[1:])
    assert [m.name for m in advice.modules] == ["0", "3"]  # '2' is the same module as '0'
    assert [m.calls for m in advice.modules] == [6, 3]


def test_report_table_json_and_plot(tmp_path: Any) -> None:
    model, batch, loss_fn = loud_task()
    advice = mixprec.advise(model, batch, loss_fn, candidates=["fp16", "bf16"], check=True)
    assert str(advice.policy) == "loud.fc=bf16"  # bf16 serves the layer fp16 cannot
    table = advice.table()
    for text in ("loud.fc", "loud.fc=bf16", "init_scale", "predicted", "measured", "-inf"):
        assert text in table
    data = json.loads(advice.to_json())
    assert mixprec.Policy(data["policy"]) == advice.policy
    assert data["modules"][1]["measurements"][0]["model_grad_sqnr"] == "-inf"
    assert data["modules"][1]["fp16"]["output_overflow"] > 0
    path = tmp_path / "advice.png"
    fig = advice.plot(path)
    assert path.stat().st_size > 1000 and len(fig.axes) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"candidates": ["fp64"]}, "unknown precision rule"),
        ({"candidates": ["fp32"]}, "not a low precision"),
        ({"candidates": []}, "empty"),
        ({"candidates": ["fp16", "half"]}, "twice"),
        ({"min_sqnr": math.nan}, "min_sqnr"),
        ({"keep_at_most": -1}, "keep_at_most"),
        ({"keep_at_most": True}, "keep_at_most"),
        ({"modules": ["nope.*"]}, "matches no submodule.*'0'"),
        ({"modules": [42]}, "qualified-name"),
        ({"modules": [""]}, "root"),
        ({"check": 1}, "check"),
    ],
)
def test_bad_arguments_raise_config_error(kwargs: dict[str, Any], match: str) -> None:
    model, batch = _mlp()
    with pytest.raises(ConfigError, match=match):
        mixprec.advise(model, batch, mse, **kwargs)


def test_overlapping_modules_are_refused() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 1))
    with pytest.raises(ConfigError, match="contains the other"):
        mixprec.advise(model, torch.randn(3, 2), lambda m, b: m(b).sum(), modules=["0", "0.0"])


@pytest.mark.parametrize(
    ("loss_fn", "match"),
    [
        (lambda m, b: 3.0, "returned float"),
        (lambda m, b: m(b[0]), "shape \\(64, 4\\)"),
        (lambda m, b: m(b[0]).sum().detach(), "does not require grad"),
        (lambda m, b: m(b[0]).sum() * math.inf, "inf/NaN gradients"),
    ],
)
def test_bad_loss_functions_are_named(loss_fn: Any, match: str) -> None:
    model, batch = _mlp()
    before = _state(model)
    with pytest.raises(ConfigError, match=match):
        mixprec.advise(model, batch, loss_fn)
    _assert_same_state(before, model)


def test_a_module_that_does_not_run_is_reported_and_left_out() -> None:
    model, batch = _mlp()
    model.add_module("unused", nn.Linear(4, 4))
    advice = mixprec.advise(model, batch, lambda m, b: F.mse_loss(m[:5](b[0]), b[1]))
    assert "unused" not in [m.name for m in advice.modules]
    assert any("unused did not run" in n for n in advice.notes)


def test_docstring_examples_run() -> None:
    import doctest

    from mixprec._src.advisor import advise as api

    result = doctest.testmod(api)
    assert result.failed == 0 and result.attempted >= 5


class _ConvHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(torch.relu(self.conv(x)).flatten(1))))


def test_fp8_candidates_serve_linears_only() -> None:
    torch.manual_seed(0)
    model = _ConvHead()
    batch = (torch.randn(32, 4, 16), torch.randn(32, 4))
    advice = mixprec.advise(model, batch, mse, candidates=["fp8", "fp8:rowwise"], check=True)
    rows = {m.name: m for m in advice.modules}
    assert rows["conv"].measurements == () and rows["conv"].choice == "bf16"
    assert [x.candidate for x in rows["fc"].measurements] == ["fp8", "fp8:rowwise"]
    assert rows["fc"].measurements[1].fp8 is not None
    assert rows["fc"].measurements[1].fp8.recipe == "rowwise"
    assert str(advice.policy) == "nn.Linear=fp8"  # no target: the cheapest everywhere
    assert advice.kept_precision == "bf16" and advice.dtype == torch.bfloat16
    with pytest.raises(ConfigError, match=r"serves nn\.Linear"):
        mixprec.advise(model, batch, mse, candidates=["fp8"], modules=["conv"])


def test_fp8_isolated_figures_agree_with_torchao() -> None:
    """One Linear at a time in fp8: the advisor's whole-model gradient SQNR against torchao's
    emulated Float8Linear swapped in for that layer (float32 around it; the advisor rounds the
    fp8 matmul's result to the region's bf16, hence a small tolerance). Measured whole (one
    pass), as torchao runs it; measured per matmul, the three matmuls' errors added stay within
    1 dB of it (the within-module additivity the per-matmul search relies on)."""
    pytest.importorskip("torchao.float8", reason="torchao is the test-only fp8 oracle")
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    model, batch = _mlp()
    whole = mixprec.advise(model, batch, mse, candidates=["fp8:rowwise"], per_matmul=False)
    split = mixprec.advise(model, batch, mse, candidates=["fp8:rowwise"])
    config = Float8LinearConfig.from_recipe_name("rowwise")
    config = Float8LinearConfig(**{**config.__dict__, "emulate": True})
    ref = _grads(copy.deepcopy(model), batch)
    for row, parts in zip(whole.modules, split.modules, strict=True):
        twin = copy.deepcopy(model)
        twin[int(row.name)] = Float8Linear.from_float(twin[int(row.name)], config=config)
        oracle = _sqnr(_grads(twin, batch), ref)
        assert row.measurements[0].model_grad_sqnr == pytest.approx(oracle, abs=0.3), row.name
        assert parts.measurements[0].matmuls is not None
        assert parts.measurements[0].model_grad_sqnr == pytest.approx(oracle, abs=1.0), row.name


def test_the_prediction_line_says_what_an_infinite_region_sqnr_means() -> None:
    """An infinite SQNR of the region with every measured module in fp32: those ops added no
    error (it printed "the ops between the measured modules alone: inf dB")."""
    import doctest

    from mixprec._src.advisor.report import table

    assert "no measurable error" in table.between(float("inf"))
    assert "inf" not in table.between(float("inf"))
    assert table.between(66.6).endswith("every module in fp32: 66.6 dB")
    assert doctest.testmod(table).failed == 0
