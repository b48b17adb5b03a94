"""mixprec.Watch: re-measures a policy during training, leaves the model's state alone, warns
when outliers squeeze an fp8 tensor, proposes the updated policy, writes TensorBoard scalars."""

from __future__ import annotations

import copy
import math
import random
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.errors import ConfigError, MixprecWarning

# These tests call Watch.step() with no training forward between checks (they test the checks);
# the warning that the watch saw no training forward is tested in test_advisor_figures.py.
_NO_FORWARD = "mixprec.Watch saw no training forward"
pytestmark = pytest.mark.filterwarnings(f"ignore:{_NO_FORWARD}")

SINKS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
    )


def _batch(gain: float, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 16, generator=gen)
    y = torch.sin(x[:, :4])
    x[:SINKS] *= gain  # rows the loss leaves out
    return x, y


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x)[SINKS:], y[SINKS:])


@pytest.fixture(scope="module")
def advice() -> mixprec.types.Advice:
    return mixprec.advise(
        _model(), _batch(1.0), loss_fn, candidates=["fp8", "fp8:rowwise"], min_sqnr=20.0
    )


def test_checks_every_n_steps_in_turn_and_reuses_the_last_batch(advice: Any) -> None:
    model = _model()
    watch = mixprec.Watch(model, loss_fn, advice, every=3, sample=1)
    reports = [watch.step(_batch(1.0) if i == 0 else None) for i in range(9)]
    assert [r is not None for r in reports] == [False, False, True] * 3
    assert [r.step for r in reports if r is not None] == [3, 6, 9]
    names = [rec.name for rec in watch.history()]
    assert names == ["0", "2", "4"]  # one module per check, in turn
    for rec in watch.history():
        assert rec.candidate == "fp8" and rec.reference_sqnr is not None
        assert rec.margin is not None and 0 < rec.margin < 40  # fp8 below bf16
        assert rec.saturated is not None and rec.flushed is not None
    assert all(not r.alerts for r in reports if r is not None)  # nothing changed


def test_a_check_leaves_parameters_grads_rng_and_mode_as_they_were(advice: Any) -> None:
    model = _model()
    loss_fn(model, _batch(1.0)).backward()
    model.eval()
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]
    rng, py = torch.get_rng_state(), random.getstate()
    watch = mixprec.Watch(model, loss_fn, advice, every=1, sample=3)
    assert watch.step(_batch(1.0)) is not None
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    assert all(a is p.grad for a, p in zip(grads, model.parameters(), strict=True))
    assert torch.equal(rng, torch.get_rng_state()) and py == random.getstate()
    assert not any(m.training for m in model.modules())


def test_growing_outliers_raise_a_warning_and_propose_rowwise(advice: Any) -> None:
    model = _model()
    seen: list[Any] = []
    watch = mixprec.Watch(model, loss_fn, advice, every=1, sample=3, hook=seen.append)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", _NO_FORWARD)
        assert not watch.step(_batch(1.0)).alerts  # the first check: the margins' baseline
    with pytest.warns(MixprecWarning, match=r"dB below bf16 at this step.*propose: .*rowwise"):
        report = watch.step(_batch(1e6))
    assert report is not None and report.alerts and len(seen) == 2
    assert report.policy is not None and report.policy != advice.policy
    flushed = {rec.name: rec.flushed for rec in report.records}
    assert min(flushed.values()) > 0.5  # the sinks squeeze every other row below e4m3
    lost = [rec.margin for rec in report.records]
    first = [rec.margin for rec in watch.history()[:3]]
    assert all(a > b + 6 for a, b in zip(lost, first, strict=True))
    assert report.predicted_sqnr < advice.predicted_sqnr - 6
    assert set(watch._flagged) == {"0", "2", "4"}  # checked again at the next check


def test_a_16_bit_advice_is_watched_without_a_reference_pass() -> None:
    model = _model()
    advice = mixprec.advise(model, _batch(1.0), loss_fn, candidates=["fp16"])
    watch = mixprec.Watch(model, loss_fn, advice, every=1, sample=2)
    report = watch.step(_batch(1.0))
    assert report is not None and not report.alerts
    assert all(rec.reference_sqnr is None and rec.margin is None for rec in report.records)
    assert all(rec.saturated is None for rec in report.records)
    with pytest.warns(MixprecWarning, match="gives inf/NaN.*propose: .*=fp32"):
        report = watch.step(_batch(1e8))  # fp16 overflows: inf
    assert report is not None and any("inf/NaN" in a for a in report.alerts)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every": 0}, "every must be an int >= 1"),
        ({"sample": 1.5}, "sample must be an int >= 1"),
        ({"tolerance": -1}, "tolerance must be a number >= 0"),
        ({"rise": math.nan}, "rise must be a number >= 0"),
        ({"hook": 3}, "hook must be None or a function"),
        ({"start_step": -1}, "start_step must be the training loop's step"),
        ({"start_step": 2.0}, "start_step must be the training loop's step"),
    ],
)
def test_bad_arguments(advice: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        mixprec.Watch(_model(), loss_fn, advice, **kwargs)


def test_an_advice_for_another_model_and_a_check_without_a_batch(advice: Any) -> None:
    with pytest.raises(ConfigError, match="modules the model does not have"):
        mixprec.Watch(nn.Sequential(nn.Linear(16, 4)), loss_fn, advice)
    with pytest.raises(ConfigError, match=r"must be what mixprec\.advise returned"):
        mixprec.Watch(_model(), loss_fn, "nn.Linear=fp8")
    watch = mixprec.Watch(_model(), loss_fn, advice, every=1)
    with pytest.raises(ConfigError, match="no batch to check on"):
        watch.step()


class _Writer:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, float(value), step))


def test_tensorboard_scalars(advice: Any) -> None:
    from mixprec.integrations.tensorboard import TensorBoardHook

    writer = _Writer()
    board = TensorBoardHook(writer)
    watch = mixprec.Watch(
        copy.deepcopy(_model()), loss_fn, advice, every=2, hook=board.record_watch
    )
    watch.step(_batch(1.0))
    watch.step()
    tags = {tag for tag, _, _ in writer.scalars}
    assert {"mixprec/watch/predicted_sqnr", "mixprec/watch/alerts"} <= tags
    assert {"mixprec/watch/0/sqnr", "mixprec/watch/0/margin", "mixprec/watch/0/flushed"} <= tags
    assert {step for _, _, step in writer.scalars} == {2}


# --- a phase switch ---------------------------------------------------------------------------


def _train_step(model: nn.Module, policy: Any, batch: Any) -> None:
    with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
        loss = loss_fn(model, batch)
    loss.backward()
    model.zero_grad()


def test_a_module_that_loses_ground_gets_its_forward_switched_to_16_bit(
    advice: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """With a schedule and apply=True, the switch goes into the schedule from the next step on
    (the steps before keep their policy), is logged and said in the warning; the next check
    measures the modules as the schedule now runs them, and the loop training the schedule's
    policies is not warned about."""
    from mixprec._src.advisor.choose.policy import rule_in_force

    model = _model()
    schedule = mixprec.Schedule({0: advice.policy, 50: advice.policy})
    watch = mixprec.Watch(model, loss_fn, advice, every=1, sample=3, schedule=schedule, apply=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", _NO_FORWARD)
        _train_step(model, schedule.at(0), _batch(1.0))
        assert not watch.step(_batch(1.0)).alerts
    applied = pytest.warns(MixprecWarning, match=r"Applied to the schedule: .*bf16/")
    with applied, caplog.at_level("WARNING", logger="mixprec"):
        report = watch.step(_batch(1e6))
    assert report is not None and report.switch is not None and report.applied
    assert any("mixprec.Watch applied" in r.message for r in caplog.records)
    assert schedule.at(1) is advice.policy  # before the switch: as it was
    for start in (2, 50):  # the phase in force and the later one
        switched = schedule.at(start)
        for rec in report.records:
            rule = rule_in_force(switched, model, rec.name)
            assert rule is not None and rule.matmuls is not None and rule.matmuls[0] == "bf16"
            before = rule_in_force(advice.policy, model, rec.name)
            assert before is not None and rule.matmuls[1:] == before.matmuls[1:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixprecWarning)  # the alerts stand: the batch is bad
        _train_step(model, schedule.at(2), _batch(1.0))
        later = watch.step(_batch(1e6))
    assert later is not None
    assert all(r.candidate.startswith("bf16/") for r in later.records)
    trained = [w for w in watch._warned if w is not None]
    assert not trained  # the schedule's policies are what the loop is meant to train


def test_without_apply_the_switch_is_only_proposed(advice: Any) -> None:
    model = _model()
    schedule = mixprec.Schedule(advice.policy)
    watch = mixprec.Watch(model, loss_fn, advice, every=1, sample=3, schedule=schedule)
    watch.step(_batch(1.0))
    with pytest.warns(MixprecWarning, match="A phase switch would run their forward in 16-bit"):
        report = watch.step(_batch(1e6))
    assert report is not None and report.switch is not None and not report.applied
    assert schedule.phases == ((0, advice.policy),)
    with pytest.raises(ConfigError, match="apply=True needs schedule="):
        mixprec.Watch(model, loss_fn, advice, apply=True)
    with pytest.raises(ConfigError, match=r"schedule must be a mixprec\.Schedule"):
        mixprec.Watch(model, loss_fn, advice, schedule="nn.Linear=fp8")  # type: ignore[arg-type]


def test_a_switch_applied_where_a_phase_was_planned_changes_that_phase(advice: Any) -> None:
    """The step the switch starts at already begins a planned phase: that phase's policy is the
    one switched (not the phase before it, which would replace the plan)."""
    from mixprec._src.advisor.choose.policy import rule_in_force

    model = _model()
    planned = mixprec.Policy("nn.Linear=fp8:rowwise")
    schedule = mixprec.Schedule({0: advice.policy, 2: planned})
    watch = mixprec.Watch(model, loss_fn, advice, every=1, sample=3, schedule=schedule, apply=True)
    watch.step(_batch(1.0))
    with pytest.warns(MixprecWarning, match="Applied to the schedule"):
        report = watch.step(_batch(1e6))  # measured at step 1, applied from step 2
    assert report is not None and report.applied
    assert schedule.at(1) is advice.policy
    for rec in report.records:
        rule = rule_in_force(schedule.at(2), model, rec.name)
        assert rule is not None and rule.matmuls == ("bf16", "fp8:rowwise", "fp8:rowwise")


def test_a_planned_change_of_rule_starts_a_baseline_of_its_own(advice: Any) -> None:
    """A schedule that moves the modules to a coarser recipe is not drift: the margin of the new
    rule is compared with its own first figure."""
    model = _model()
    coarse = mixprec.Policy("0=nvfp4, 2=nvfp4, 4=fp8")
    schedule = mixprec.Schedule({0: advice.policy, 1: coarse})
    watch = mixprec.Watch(model, loss_fn, advice, every=1, sample=3, schedule=schedule)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", _NO_FORWARD)
        first = watch.step(_batch(1.0))
        then = watch.step(_batch(1.0))
        again = watch.step(_batch(1.0))
    assert first is not None and then is not None and again is not None
    assert [r.candidate for r in then.records] == ["nvfp4", "nvfp4", "fp8"]
    assert not first.alerts and not then.alerts and not again.alerts
    pairs = zip(then.records, first.records, strict=True)
    lower = [a.margin - b.margin for a, b in pairs if a.margin is not None and b.margin is not None]
    assert lower and max(lower) > 6  # nvfp4 is far below fp8, yet no alert: not drift


def test_a_mix_s_fractions_are_compared_with_its_first_figures() -> None:
    """A module whose choice is a mix of recipes has no fp8 figures in the advice: its clipped
    and flushed fractions are compared with the watch's first figures for it."""
    from mixprec.types import WatchRecord

    advice = mixprec.advise(
        _model(), _batch(1.0), loss_fn, candidates=["nvfp4", "mxfp8"], min_sqnr=20.0
    )
    row = next(m for m in advice.modules if "/" in m.choice)
    watch = mixprec.Watch(_model(), loss_fn, advice, every=1, sample=3)
    calm = WatchRecord(1, row.name, row.choice, 30.0, None, 30.0, 0.0, 0.01, 0.0)
    loud = WatchRecord(2, row.name, row.choice, 30.0, None, 30.0, 0.0, 0.5, 0.0)
    assert watch._problem(calm, row) is None
    problem = watch._problem(loud, row)
    assert (
        problem is not None and "flushes to 0 50%" in problem and "when first measured" in problem
    )


def test_a_resumed_run_measures_the_phase_it_trains(advice: Any) -> None:
    """A loop resumed at step 60 of a schedule whose second phase starts at 50: a watch told the
    loop's step (``start_step=`` or ``step(step=)``) checks at the uninterrupted run's steps and
    measures the phase the loop trains, as the watch that ran from step 0 does; one that counts
    its own calls from 0 measures the first phase."""
    from mixprec._src.advisor.choose.policy import rule_in_force

    coarse = mixprec.Policy("0=nvfp4, 2=nvfp4, 4=fp8")
    schedule = mixprec.Schedule({0: coarse, 50: advice.policy})
    batch = _batch(1.0)

    def watch(**kwargs: Any) -> Any:
        return mixprec.Watch(_model(), loss_fn, advice, sample=3, schedule=schedule, **kwargs)

    whole = watch(every=61)
    reports = [whole.step(batch) for _ in range(61)]  # steps 0..60, a check after step 60
    assert reports[:60] == [None] * 60 and reports[60] is not None
    resumed = watch(every=61, start_step=60).step(batch)
    told = watch(every=61)
    assert told.step(batch, step=59) is None  # step 59: no check due
    told_report = told.step(batch, step=60)
    counted = watch(every=1).step(batch)  # counts from 0: measures step 0's phase
    in_phase = [str(rule_in_force(schedule.at(60), _model(), r.name)) for r in reports[60].records]
    assert in_phase != ["nvfp4"] * 2 + ["fp8"]  # the two phases differ: the test can tell
    for report in (resumed, told_report):
        assert report is not None
        assert [(r.step, r.candidate) for r in report.records] == [
            (r.step, r.candidate) for r in reports[60].records
        ]
        assert [r.candidate for r in report.records] == in_phase
    assert counted is not None and [r.candidate for r in counted.records] == ["nvfp4"] * 2 + ["fp8"]
    with pytest.raises(ConfigError, match="step must be the training loop's step"):
        told.step(batch, step=-3)


def test_a_rule_by_any_name_of_a_shared_module_is_the_rule_the_watch_measures() -> None:
    """One Linear at two places (``0`` and ``2``): a phase that names it by its second name
    rules it (the forward's resolver), and the watch measures that rule at that phase."""
    torch.manual_seed(0)
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.GELU(), shared)
    gen = torch.Generator().manual_seed(3)
    batch = (torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen))

    def mse(m: nn.Module, b: Any) -> torch.Tensor:
        return F.mse_loss(m(b[0]), b[1])

    advice = mixprec.advise(model, batch, mse, candidates=["fp8"], min_sqnr=0.0)
    assert [m.name for m in advice.modules] == ["0"] and advice.modules[0].choice == "fp8"
    schedule = mixprec.Schedule({0: advice.policy, 1: "2=nvfp4"})
    watch = mixprec.Watch(model, mse, advice, every=1, schedule=schedule)
    first, second = watch.step(batch), watch.step(batch)
    assert first is not None and [r.candidate for r in first.records] == ["fp8"]
    assert second is not None and [r.candidate for r in second.records] == ["nvfp4"]
