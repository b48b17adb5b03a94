"""The advisor with the block-scaled recipes as candidates, cheapest first:
``["nvfp4", "mxfp8", "bf16"]`` means try fp4, then mxfp8, else keep the Linear in bf16.

On the GPT-like model of examples/advise_gpt.py (width 64, 2 blocks, 9 Linears whose features
the 16- and 32-element blocks tile; random init, a generated batch): every Linear is measured
in each candidate, in that order; without a target every Linear takes fp4; a target moves the
modules up one format at a time (mxfp8 before bf16), no cheaper single choice would still meet
it; and the prediction (the modules' noise added up) is checked against the policy applied,
within 0.5 dB as for fp8 (test_advisor_gpt.py)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import mixprec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "advise_gpt.py"
CANDIDATES = ["nvfp4", "mxfp8", "bf16"]


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("advise_gpt_blocks", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def task() -> tuple[torch.nn.Module, Any, Any]:
    example = _example()
    torch.manual_seed(0)
    model = example.GPT(vocab=256, width=64, depth=2, heads=4, seq=32)
    tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(1))
    return model, (tokens[:, :-1], tokens[:, 1:]), example.next_token_loss


def _advise(task: Any, **kwargs: Any) -> mixprec.types.Advice:
    model, batch, loss_fn = task
    return mixprec.advise(
        model, batch, loss_fn, candidates=CANDIDATES, check=True, per_matmul=False, **kwargs
    )


@pytest.fixture(scope="module")
def cheapest(task: Any) -> mixprec.types.Advice:
    return _advise(task)


def _impact(advice: mixprec.types.Advice) -> dict[str, dict[str, float]]:
    return {
        m.name: {x.candidate: x.model_grad_sqnr for x in m.measurements} for m in advice.modules
    }


def _predict(advice: mixprec.types.Advice, choice: dict[str, str]) -> float:
    """The additive prediction: the region's noise plus each module's in its choice."""
    impact = _impact(advice)
    noise = 10 ** (-advice.region_sqnr / 10)
    noise += sum(10 ** (-impact[name][c] / 10) for name, c in choice.items())
    return -10 * math.log10(noise)


def _checked(advice: mixprec.types.Advice) -> None:
    assert advice.measured_sqnr is not None
    assert abs(advice.measured_sqnr - advice.predicted_sqnr) <= 0.5
    choice = {m.name: m.choice for m in advice.modules}
    assert _predict(advice, choice) == pytest.approx(advice.predicted_sqnr, abs=0.01)


def test_every_linear_is_measured_in_each_candidate_in_order(
    cheapest: mixprec.types.Advice,
) -> None:
    assert cheapest.candidates == tuple(CANDIDATES)
    linears = [m for m in cheapest.modules if m.kind == "Linear"]
    assert len(linears) == 9 == len(cheapest.modules)
    for m in linears:
        assert m.served and m.candidates == tuple(CANDIDATES)
        assert [x.candidate for x in m.measurements] == CANDIDATES
        fp4, mx, bf16 = (x.model_grad_sqnr for x in m.measurements)
        assert fp4 + 6 < mx < bf16 - 6, m.name  # e2m1 is far noisier than e4m3, e4m3 than bf16
        fp8 = m.measurements[0].fp8
        assert fp8 is not None and fp8.recipe == "nvfp4" and fp8.input.nonfinite == 0


def test_without_a_target_every_linear_takes_fp4(cheapest: mixprec.types.Advice) -> None:
    assert str(cheapest.policy) == "nn.Linear=nvfp4"
    assert cheapest.kept == () and cheapest.dtype == torch.bfloat16
    _checked(cheapest)
    assert cheapest.cheapest is not None
    assert cheapest.cheapest.measured == pytest.approx(cheapest.measured_sqnr, abs=1e-9)


@pytest.mark.parametrize("above", ["all-fp4", "all-mxfp8"])
def test_a_target_moves_modules_up_one_format_at_a_time(
    task: Any, cheapest: mixprec.types.Advice, above: str
) -> None:
    """6 dB above all-fp4: some Linears move to mxfp8 and none to bf16. 3 dB above all-mxfp8:
    some are kept in bf16. Either way no module could take the next cheaper format and the
    prediction still meet the target, and the applied policy measures what was predicted."""
    names = [m.name for m in cheapest.modules]
    all_mx = _predict(cheapest, dict.fromkeys(names, "mxfp8"))
    assert cheapest.measured_sqnr is not None
    target = cheapest.measured_sqnr + 6 if above == "all-fp4" else all_mx + 3
    advice = _advise(task, min_sqnr=target)
    assert advice.met and advice.predicted_sqnr >= target and advice.kept == ()
    _checked(advice)
    assert advice.measured_sqnr is not None and advice.measured_sqnr >= target - 0.5
    choice = {m.name: m.choice for m in advice.modules}
    used = set(choice.values())
    if above == "all-fp4":
        assert used == {"nvfp4", "mxfp8"}
    else:
        assert "bf16" in used
    for name, c in choice.items():
        if c == CANDIDATES[0]:
            continue
        cheaper = {**choice, name: CANDIDATES[CANDIDATES.index(c) - 1]}
        assert _predict(advice, cheaper) < target, (name, c)
    model = task[0]
    for name, module in model.named_modules():
        if name in choice:
            rule = advice.policy.module_rule(module, name)
            assert (str(rule) if rule is not None else "bf16") == choice[name], name
