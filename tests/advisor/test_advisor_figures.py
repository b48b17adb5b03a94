"""Figures that are always true (#29), each held over variants: a recipe is an option on a GPU
only where that GPU runs it and every time figure says what it left out; a module whose input
needs no gradient is charged nothing of the input-gradient GEMM; the reference is float32
wherever the advisor is called; compiled models are refused before any pass; the watch
re-proposes with the advice's own objective, notices a policy other than the advice's and names
a module replaced since the advice."""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec._src.advisor.arguments import Candidate
from mixprec._src.advisor.speed.gpus import GPUS
from mixprec._src.advisor.speed.model import BF16, ZERO, Operands, Shape, module_time
from mixprec._src.advisor.speed.operands import operands, recipe_operands, runs_on
from mixprec._src.fp8.recipes import RECIPES
from mixprec.errors import ConfigError, MixprecWarning


def _net(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width), nn.LayerNorm(width)
    )


def _batch(width: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(64, width, generator=gen), torch.randn(64, width, generator=gen)


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.mse_loss(model(batch[0]).float(), batch[1])


# --- a recipe is an option only where the GPU runs it ---------------------------------------

CANDIDATE_SETS = (["nvfp4", "mxfp8", "bf16"], ["mxfp8", "fp8"], ["nvfp4"])


@pytest.mark.parametrize(
    ("gpu", "objective", "keep"),
    list(itertools.product(("h100", "b200"), ("fewest_kept", "speed"), (None, 0))),
)
def test_every_choice_runs_on_the_gpu_and_every_sum_says_what_it_left_out(
    gpu: str, objective: str, keep: int | None
) -> None:
    spec = GPUS[gpu]
    for words in CANDIDATE_SETS:
        advice = mixprec.advise(
            _net(),
            _batch(),
            mse,
            candidates=words,
            gpu=gpu,
            objective=objective,
            keep_at_most=keep,
            modules=[nn.Linear, nn.LayerNorm],
        )
        assert advice.step is not None
        served = [m for m in advice.modules if m.served]
        for m in served:
            if m.choice in m.candidates:  # a candidate chosen: one the GPU runs
                assert runs_on(spec, Candidate.of(m.choice)), (gpu, words, m.name, m.choice)
                assert m.time is not None and m.time.total > 0
            for x in m.measurements:  # measured in every serving candidate, timed where it runs
                assert (x.time is not None) == runs_on(spec, Candidate.of(x.candidate))
            if not any(runs_on(spec, Candidate.of(w)) for w in m.candidates):
                assert "no kernel" in m.reason and "inf/NaN" not in m.reason
        timed = {m.name for m in advice.modules if m.served and m.time is not None}
        assert set(advice.step.left_out) == {m.name for m in advice.modules} - timed
        assert not any("inf/NaN" in n for n in advice.notes), advice.notes
        assert advice.step.left_out == ("3",)  # the LayerNorm: no GEMM to time
        text = advice.table()
        assert "not modelled: 1 measured modules not timed alone (3: no Linear" in text


def test_no_candidate_the_gpu_runs_is_kept_with_the_reason_and_no_speedup_from_nothing() -> None:
    advice = mixprec.advise(_net(), _batch(), mse, candidates=["nvfp4"], gpu="h100")
    assert advice.step is not None
    linears = [m for m in advice.modules if m.kind == "Linear"]
    assert all(m.choice == advice.kept_precision for m in linears)
    assert all("H100 SXM has no kernel for nvfp4" in m.reason for m in linears)
    assert advice.step.speedup <= 1.0  # nothing faster was chosen: no 0 µs
    assert any("no candidate the GPU runs in hardware" in n for n in advice.notes) or (
        advice.keep_at_most is None
    )


# --- a module whose input needs no gradient -----------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    recipe=st.sampled_from(sorted(RECIPES)),
    m=st.sampled_from([16, 256, 2048, 16384]),
    k=st.sampled_from([128, 2048]),
    n=st.sampled_from([128, 2048]),
    other=st.sampled_from(sorted(RECIPES)),
)
def test_without_an_input_gradient_its_gemm_operands_cost_nothing(
    recipe: str, m: int, k: int, n: int, other: str
) -> None:
    """The time without an input-gradient GEMM does not depend on that GEMM's operand formats
    (any recipe's, or 16-bit), and never exceeds the time with it."""
    gpu = GPUS["b200"]
    ops, alt = recipe_operands(recipe), recipe_operands(other)
    assert ops is not None and alt is not None
    swapped = Operands(ops.x, ops.w, alt.dy_gi, alt.w_gi, ops.dy_gw, ops.x_gw, ops.capability)
    for gi_ops in (
        swapped,
        Operands(ops.x, ops.w, BF16, BF16, ops.dy_gw, ops.x_gw, ops.capability),
    ):
        a = module_time(gpu, [Shape(m, k, n)], ops, input_grad=False)
        b = module_time(gpu, [Shape(m, k, n)], gi_ops, input_grad=False)
        assert a == b
    full = module_time(gpu, [Shape(m, k, n)], ops)
    alone = module_time(gpu, [Shape(m, k, n)], ops, input_grad=False)
    if full is not None and alone is not None:
        assert alone.input_grad == 0.0 and alone.casts <= full.casts and alone.total < full.total


def test_a_first_layer_is_not_charged_the_input_gradient_casts() -> None:
    advice = mixprec.advise(_net(), _batch(), mse, candidates=["fp8"], gpu="h100")
    first, second = advice.modules[0], advice.modules[1]
    for row, needs in ((first, False), (second, True)):
        x = row.measurement("fp8")
        assert x is not None and x.time is not None
        assert (x.time.input_grad > 0) == needs and (x.input_grad_sqnr is not None) == needs
    shape = [Shape(64, 32, 64)]
    ops = operands(Candidate.of("fp8"), torch.bfloat16)
    expected = module_time(GPUS["h100"], shape, ops, input_grad=False)
    assert first.measurement("fp8").time == expected  # type: ignore[union-attr]


class _Shared(nn.Module):
    """One Linear called on some inputs that need no gradient and on some that do."""

    def __init__(self, pattern: tuple[bool, ...]) -> None:
        super().__init__()
        self.pattern = pattern
        self.lin, self.out = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.out(x)  # a hidden value: needs a gradient
        total = h
        for grad in self.pattern:
            total = total + self.lin(h if grad else x)
        return total


@pytest.mark.parametrize("pattern", [(False,), (True,), (False, True), (True, False, False)])
@pytest.mark.parametrize("gpu", ["h100", "b200"])
def test_each_call_is_charged_the_input_gradient_gemm_only_if_it_runs_it(
    pattern: tuple[bool, ...], gpu: str
) -> None:
    """Differential: a module's time is the sum over its calls of one call's time, with or
    without the input-gradient GEMM as that call's input needs a gradient."""
    torch.manual_seed(0)
    model, batch = _Shared(pattern), _batch()
    advice = mixprec.advise(model, batch, mse, candidates=["fp8", "bf16"], gpu=gpu)
    row = next(m for m in advice.modules if m.name == "lin")
    assert row.calls == len(pattern)
    spec = GPUS[gpu]
    for word in ("fp8", "bf16"):
        ops = operands(Candidate.of(word), torch.bfloat16)
        alone = [module_time(spec, [Shape(64, 32, 32)], ops, input_grad=g) for g in pattern]
        x = row.measurement(word)
        assert x is not None and x.time is not None and all(t is not None for t in alone)
        want = sum((t for t in alone if t is not None), start=ZERO)
        assert x.time == want


# --- the reference is float32 wherever the advisor is called --------------------------------


def _json(advice: mixprec.types.Advice) -> str:
    return advice.to_json()


def _state() -> tuple[object, ...]:
    autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    return (*autocast, torch.is_grad_enabled(), torch.is_inference_mode_enabled())


def _nested() -> Any:
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    stack.enter_context(mixprec.autocast("cpu", dtype=torch.float16, policy="2=fp8:rowwise"))
    return stack


@pytest.mark.parametrize(
    "region",
    [
        lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        lambda: mixprec.autocast("cpu", dtype=torch.bfloat16),
        lambda: mixprec.autocast("cpu", dtype=torch.float16, policy="nn.Linear=fp8"),
        lambda: mixprec.autocast("cpu", dtype=torch.bfloat16, policy="0=fp32, nn.GELU=bf16"),
        _nested,
        torch.no_grad,
        torch.inference_mode,
    ],
)
def test_advise_and_watch_inside_a_region_measure_what_they_measure_outside(region: Any) -> None:
    """Inside a 16-bit region (torch's, mixprec's, nested) or a no-grad/inference context, the
    passes measure what they measure outside: float32 reference, grad on."""
    kwargs = {"candidates": ["fp8", "bf16"], "min_sqnr": 25.0}
    outside = mixprec.advise(_net(), _batch(), mse, **kwargs)
    model, batch = _net(), _batch()
    with region():
        before = _state()
        inside = mixprec.advise(model, batch, mse, **kwargs)
        assert _state() == before  # the caller's region is back in force
    assert _json(inside) == _json(outside)
    records = []
    for where in (contextlib.nullcontext, region):
        model, batch = _net(), _batch()
        watch = mixprec.Watch(model, mse, outside, every=1, sample=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MixprecWarning)
            with where():
                report = watch.step(batch)
        assert report is not None
        records.append(report.records)
    assert records[0] == records[1]


# --- compiled models ----------------------------------------------------------------------


def test_compiled_wrappers_are_refused_before_any_pass() -> None:
    """torch.compile's wrapper, around the model or one of its modules, names the modules under
    ``_orig_mod``: refused, before any pass, by advise and by Watch."""
    calls: list[int] = []

    def counting(model: nn.Module, batch: Any) -> torch.Tensor:
        calls.append(1)
        return mse(model, batch)

    inner = _net()
    inner[0] = torch.compile(inner[0])  # type: ignore[assignment]
    advice = mixprec.advise(_net(), _batch(), mse, candidates=["fp8"])
    for model, where in ((torch.compile(_net()), "model is"), (inner, "model.0 is")):
        message = f"{where} a torch.compile'd module.*_orig_mod"
        for candidates in (["bf16"], ["fp8"]):
            with pytest.raises(ConfigError, match=message):
                mixprec.advise(model, _batch(), counting, candidates=candidates)
        with pytest.raises(ConfigError, match=message):
            mixprec.Watch(model, counting, advice)
    assert calls == []


@pytest.mark.parametrize("where", ["model", "module"])
@pytest.mark.parametrize("words", [["bf16"], ["fp16"], ["fp8", "bf16"], ["mxfp8"]])
def test_a_model_compiled_in_place_is_measured_as_its_eager_self(
    where: str, words: list[str]
) -> None:
    """Differential: Module.compile() keeps the modules and their names; advise and the watch's
    checks (also when the model was compiled after the watch began) measure its eager forward:
    the same figures as the model never compiled."""
    eager = mixprec.advise(_net(64), _batch(64), mse, candidates=words, min_sqnr=20.0)
    baseline = mixprec.Watch(_net(64), mse, eager, every=1, sample=2)
    model = _net(64)
    watch = mixprec.Watch(model, mse, eager, every=1, sample=2)
    (model if where == "model" else model[2]).compile(backend="eager")
    mse(model, _batch(64))  # compiled before the advisor runs
    advice = mixprec.advise(model, _batch(64), mse, candidates=words, min_sqnr=20.0)
    assert _json(advice) == _json(eager)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixprecWarning)
        got, want = watch.step(_batch(64)), baseline.step(_batch(64))
    assert got is not None and want is not None and got.records == want.records


# --- the watch ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("objective", "gpu"),
    [("fewest_kept", None), ("fewest_kept", "b200"), ("speed", "h100"), ("speed", "b200")],
)
def test_with_nothing_lost_the_watch_reproposes_the_advice(objective: str, gpu: str | None) -> None:
    """The watch's search is the advice's: on the advice's own figures it finds its policy."""
    for words, target, keep in (
        (["nvfp4", "mxfp8", "bf16"], 20.0, None),
        (["fp8", "bf16"], None, 1),
    ):
        advice = mixprec.advise(
            _net(64),
            _batch(64),
            mse,
            candidates=words,
            min_sqnr=target,
            keep_at_most=keep,
            gpu=gpu,
            objective=objective,
        )
        watch = mixprec.Watch(_net(64), mse, advice)
        assert watch._proposal() is None, (objective, gpu, words, str(advice.policy))


def test_the_watch_warns_once_when_the_loop_trains_another_policy() -> None:
    advice = mixprec.advise(_net(), _batch(), mse, candidates=["fp8"], keep_at_most=1)
    other = mixprec.Policy("nn.Linear=bf16")
    for policy, expected in ((advice.policy, None), (other, "nn.Linear=bf16"), (None, "outside")):
        model = _net()
        watch = mixprec.Watch(model, mse, advice, every=1000)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                if policy is None:
                    mse(model, _batch()).backward()
                else:
                    with mixprec.autocast("cpu", dtype=torch.bfloat16, policy=policy):
                        loss = mse(model, _batch())
                    loss.backward()
                with torch.no_grad():  # an evaluation forward is not training
                    model(_batch()[0])
                watch.step(_batch())
        found = [str(w.message) for w in caught if "not the advice's policy" in str(w.message)]
        assert len(found) == (0 if expected is None else 1), found
        if expected is not None:
            assert expected in found[0]


@pytest.mark.parametrize("how", ["wrapper", "in place", "fullgraph"])
def test_the_watch_notices_the_policy_a_compiled_loop_trains(how: str) -> None:
    """The same notice when the loop trains the model compiled (torch.compile's wrapper, a
    model compiled in place, fullgraph=True: no graph break), once per other policy."""
    advice = mixprec.advise(_net(), _batch(), mse, candidates=["fp8"], keep_at_most=1)
    other = mixprec.Policy("nn.Linear=bf16")
    for policies, expected in (
        ([advice.policy] * 3, []),
        ([advice.policy, other, advice.policy, other], ["'nn.Linear=bf16'"]),
        ([None, None], ["outside any mixprec.autocast policy"]),
    ):
        torch.compiler.reset()  # the compile caches of the forms above: no recompile limit
        model = _net()
        watch = mixprec.Watch(model, mse, advice, every=1000)
        if how == "in place":
            model.compile(backend="aot_eager")
        run = model if how == "in place" else torch.compile(model, backend="aot_eager")
        if how == "fullgraph":
            run = torch.compile(model, backend="aot_eager", fullgraph=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for policy in policies:
                region = mixprec.autocast("cpu", dtype=torch.bfloat16, policy=policy)
                with region if policy is not None else contextlib.nullcontext():
                    loss = mse(run, _batch())
                loss.backward()
                watch.step(_batch())
        found = [str(w.message) for w in caught if "not the advice's policy" in str(w.message)]
        assert len(found) == len(expected), found
        assert all(e in f for e, f in zip(expected, found, strict=True)), found


@pytest.mark.parametrize("compiled", ["before the watch", "after the watch", "never"])
def test_a_watch_that_saw_no_training_forward_says_so(compiled: str) -> None:
    """Never silent about the policy the loop trains. A model compiled before the watch: where
    Dynamo does not recompile for a hook added later (2.13) its graph runs without the watch's
    hook and the first check warns that it saw no training forward; where it does (2.14.1) the
    other policy is named. Compiled after the watch, or eager: the other policy is named."""
    advice = mixprec.advise(_net(), _batch(), mse, candidates=["bf16"], keep_at_most=1)
    other = mixprec.Policy("nn.Linear=fp32")
    torch.compiler.reset()
    model = _net()
    run: nn.Module = model
    if compiled == "before the watch":
        run = torch.compile(model, backend="eager")
        with mixprec.autocast("cpu", dtype=torch.bfloat16, policy=other):
            mse(run, _batch()).backward()
    watch = mixprec.Watch(model, mse, advice, every=2)
    if compiled == "after the watch":
        run = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            with mixprec.autocast("cpu", dtype=torch.bfloat16, policy=other):
                loss = mse(run, _batch())
            loss.backward()
            watch.step(_batch())
    unseen = [str(w.message) for w in caught if "saw no training forward" in str(w.message)]
    named = [str(w.message) for w in caught if "'nn.Linear=fp32'" in str(w.message)]
    if compiled == "before the watch" and unseen:
        assert len(unseen) == 1 and "in 2 steps" in unseen[0] and not named
        assert "Make the Watch before compiling the model" in unseen[0]
    else:
        assert not unseen and len(named) == 1


def test_a_replaced_or_removed_module_is_named() -> None:
    advice = mixprec.advise(_net(), _batch(), mse, candidates=["fp8"])
    for change, word in (
        (lambda m: m.__setitem__(0, nn.Linear(32, 64)), "replaced"),
        (lambda m: delattr(m, "0"), "removed"),
    ):
        model = _net()
        watch = mixprec.Watch(model, mse, advice, every=1, sample=3)
        change(model)
        with pytest.raises(ConfigError, match=f"watched module '0' was {word}"):
            watch.step(_batch())


# --- the text -------------------------------------------------------------------------------


def test_the_table_says_what_each_column_and_dash_means() -> None:
    advice = mixprec.advise(
        _net(), _batch(), mse, candidates=["nvfp4", "mxfp8", "bf16"], gpu="h100", min_sqnr=19.3721
    )
    text = advice.table(wide=True)
    assert "nvfp4 casts" in text and "mxfp8 casts" in text and "bf16 casts" not in text
    assert "'-': the GPU has no kernel for that recipe" in " ".join(text.split())
    assert ">= 19.4 dB" in text and "19.3721" not in text
    main = text.split("per matmul: the model-grad")[0]  # the table per matmul has no µs
    rows = [line for line in main.splitlines() if line.startswith(("0 ", "2 "))]
    assert rows and all(" - " in line for line in rows)  # nvfp4 and mxfp8: no kernel on H100


@pytest.mark.parametrize("gpu", [None, "h100", "b200"])
def test_every_mark_in_a_row_is_explained(gpu: str | None) -> None:
    """'n/a' (a recipe that cannot serve the module) is explained with the blocks; a module
    without a GEMM has a blank µs cell in the proposal too (a '-' there would say 'no
    kernel'); a prediction that holds within rounding reads +0.0, never -0.0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32))
    batch = (torch.randn(64, 8), torch.randn(64, 32))
    words = ["nvfp4", "mxfp8", "bf16"]
    advice = mixprec.advise(
        model, batch, mse, candidates=words, gpu=gpu, modules=[nn.Linear, nn.LayerNorm]
    )
    text = " ".join(advice.table(wide=True).split())
    assert "0 Linear 288 n/a" in text
    assert "0 Linear n/a n/a" in " ".join(advice.table().split())  # the default table
    assert "n/a: the candidate cannot serve that module" in text
    assert "nvfp4: 16, mxfp8: 32)" in text
    norm = next(ln for ln in advice.table(wide=True).splitlines() if ln.startswith("3 "))
    cells = norm.split("no error in any candidate")[0].split()
    assert cells[-1] == "-" and cells[-2] == "inf", norm  # the decision; no µs mark after it
    assert "-0.0" not in text


def test_the_plot_says_which_modules_its_times_leave_out() -> None:
    advice = mixprec.advise(
        _net(),
        _batch(),
        mse,
        candidates=["fp8", "bf16"],
        gpu="h100",
        modules=[nn.Linear, nn.LayerNorm],
    )
    fig = advice.plot()
    time_ax = fig.axes[1]
    assert "1 modules not timed" in time_ax.get_xlabel()
    assert [t.get_text().strip() for t in time_ax.texts] == ["not timed alone"]


@pytest.mark.parametrize(("typo", "meant"), [("fc1", "0"), ("blocks.0.mlp.fx", "blocks.0.mlp.fc")])
def test_a_module_name_typo_gets_a_did_you_mean(typo: str, meant: str) -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Module()])  # type: ignore[assignment]
    model.blocks[0].mlp = nn.Module()  # type: ignore[assignment]
    model.blocks[0].mlp.fc = nn.Linear(4, 4)  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="matches no submodule") as err:
        mixprec.advise(
            model, None, lambda m, b: m.blocks[0].mlp.fc(torch.ones(1, 4)).sum(), modules=[typo]
        )
    if meant == "0":
        assert "Did you mean" not in str(err.value)
    else:
        assert f"Did you mean {meant!r}" in str(err.value)


# --- the fastest policy without a target: measured once ------------------------------------


@pytest.mark.parametrize(
    ("words", "gpu"),
    [(None, "b200"), (["fp8", "bf16"], "h100"), (["nvfp4", "mxfp8", "bf16"], "b200")],
)
def test_the_fastest_policy_without_a_target_is_the_searchs_measured_once(
    words: list[str] | None, gpu: str
) -> None:
    """Differential: the policy predicted from the shapes and measured in one pass is the one
    the full search (every module measured alone, a target every option meets) proposes."""
    once = mixprec.advise(_net(64), _batch(64), mse, candidates=words, gpu=gpu, objective="speed")
    full = mixprec.advise(
        _net(64), _batch(64), mse, candidates=words, gpu=gpu, objective="speed", min_sqnr=-100.0
    )
    assert once.passes == 2 and full.passes > 2
    assert once.policy == full.policy
    assert once.measured_sqnr is not None and math.isfinite(once.measured_sqnr)
    assert once.step == full.step
    assert all(math.isnan(x.model_grad_sqnr) for m in once.modules for x in m.measurements)
    with pytest.raises(ConfigError, match="no per-module figures to watch"):
        mixprec.Watch(_net(64), mse, once)


def test_a_fastest_policy_that_overflows_falls_back_to_measuring_each_module() -> None:
    from tests.advisor_models import loud_task

    model, batch, loss_fn = loud_task()
    advice = mixprec.advise(
        model, batch, loss_fn, candidates=["fp16"], gpu="h100", objective="speed"
    )
    assert advice.passes > 2
    assert not any(math.isnan(x.model_grad_sqnr) for m in advice.modules for x in m.measurements)
    assert advice.kept  # the loud layer: fp16 gives inf/NaN


# --- statistics count the user's tensor ------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    recipe=st.sampled_from(sorted(RECIPES)),
    tokens=st.sampled_from([1, 3, 17, 40]),
    inf_at=st.one_of(st.none(), st.integers(0, 10_000)),
    weight_scale=st.sampled_from([1.0, 3.0, 1e-3, 2.0**20, 0.7]),
)
def test_fp8_statistics_cover_the_users_elements_only(
    recipe: str, tokens: int, inf_at: int | None, weight_scale: float
) -> None:
    """Fractions stay within [0, 1] and count over the real elements (not rows padded to the
    blocks, not a Hadamard transform's spread); one inf in the input is counted once; a block
    scale hits the top of its format only beyond float rounding (never for a scale taken from
    the amax)."""
    from mixprec._src.fp8 import hook as fp8_hook
    from mixprec._src.fp8.recipes import get_recipe
    from mixprec._src.fp8.stats import Fp8Stats

    torch.manual_seed(0)
    lin = nn.Linear(128, 128)
    with torch.no_grad():
        lin.weight.mul_(weight_scale)
    x = torch.randn(tokens, 128, requires_grad=True)
    if inf_at is not None:
        with torch.no_grad():
            x.view(-1)[inf_at % x.numel()] = float("inf")
    with Fp8Stats() as stats:
        token = fp8_hook.enter_module(lin, "lin", get_recipe(recipe), torch.float32)
        try:
            out = lin(x)
        finally:
            fp8_hook.exit_module(token)
        out.sum().backward()
    got = stats.read()["lin"]
    for operand in (got.input, got.weight, got.grad_output):
        assert 0.0 <= operand.saturated <= 1.0 and 0.0 <= operand.flushed <= 1.0
    assert got.input.nonfinite == (0 if inf_at is None else 1)
    if inf_at is None:
        assert got.weight.block_saturated == 0.0 and got.input.block_saturated == 0.0


@pytest.mark.parametrize("word", ["fp8:rowwise", "mxfp8", "fp8"])
def test_a_stable_run_raises_no_clipping_alert(word: str) -> None:
    """Scales taken from the amax (or its power of two) never clip: over a stable run with new
    batches at every check, the watch raises no clip alert (values that merely round to the
    format's maximum are not counted)."""
    model = _net(64)
    advice = mixprec.advise(model, _batch(64), mse, candidates=[word])
    watch = mixprec.Watch(model, mse, advice, every=1, sample=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    alerts = []
    for _ in range(6):
        batch = (torch.randn(64, 64, generator=gen), torch.randn(64, 64, generator=gen))
        with mixprec.autocast("cpu", dtype=advice.dtype, policy=advice.policy):
            loss = mse(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        report = watch.step(batch)
        assert report is not None
        alerts += report.alerts
        assert all(r.clipped == 0.0 for r in report.records)
    assert not [a for a in alerts if "clips" in a or "saturates" in a], alerts


@pytest.mark.parametrize(
    ("words", "why"),
    [
        (["mxfp8"], "in_features 8 is not a multiple of mxfp8's block 32"),
        (["nvfp4", "mxfp8"], "of nvfp4's block 16; in_features 8 is not a multiple of mxfp8's"),
    ],
)
def test_a_linear_no_candidate_serves_says_why(words: list[str], why: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32))
    batch = (torch.randn(16, 8), torch.randn(16, 32))
    advice = mixprec.advise(model, batch, mse, candidates=words)
    first, last = advice.modules[0], advice.modules[1]
    assert last.served and not first.served
    assert "no candidate serves Linear (" in first.reason and why in first.reason
    assert "no candidate serves Linear" in " ".join(advice.table().split())


def test_a_watched_model_still_pickles_and_the_watch_leaves_no_hook_behind() -> None:
    import gc
    import pickle

    advice = mixprec.advise(_net(), _batch(), mse, candidates=["fp8"])
    model = _net()
    watch = mixprec.Watch(model, mse, advice)
    pickle.loads(pickle.dumps(model))
    assert len(model._forward_pre_hooks) == 1
    del watch
    gc.collect()
    assert len(model._forward_pre_hooks) == 0
