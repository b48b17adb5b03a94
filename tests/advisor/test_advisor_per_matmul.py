"""The advisor per matmul: each recipe measured one matmul at a time (fprop alone, then dgrad
and wgrad), the search giving a module's three matmuls each their own format, and the
``"sqnr"`` objective (the most precise policy at a least speedup).

The figures are held to an oracle written here (the module's forward replaced by the recipe's
Linear on a ``Plan``, the rest of the model in float32, the SQNR summed by hand); the premise of
the split (dgrad's and wgrad's errors land on different gradients) is checked bitwise; the pass
count stays within twice the per-module count for three candidates.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec._src.fp8.matmul import Plan, fp8_linear
from mixprec._src.fp8.recipes import get_recipe
from mixprec.errors import ConfigError

CANDIDATES = ["nvfp4", "mxfp8", "bf16"]
BF16 = torch.bfloat16


def _model(seed: int = 0, bias: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 64, bias=bias),
        nn.GELU(),
        nn.Linear(64, 64, bias=bias),
        nn.GELU(),
        nn.Linear(64, 32, bias=bias),
    )


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(128, 64, generator=gen), torch.randn(128, 32, generator=gen)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


@pytest.fixture(scope="module")
def advice() -> mixprec.types.Advice:
    model = _model()
    torch.manual_seed(5)  # the RNG state every pass starts from (nvfp4's stochastic rounding)
    return mixprec.advise(model, _batch(), loss_fn, candidates=CANDIDATES, min_sqnr=24.0)


# ---------------------------------------------------------------- the oracle
def _grads(
    model: nn.Module, swap: dict[str, str] | None = None, hp: torch.dtype = BF16
) -> list[torch.Tensor]:
    """The parameters' gradients of one forward+backward in float32, with each module named in
    ``swap`` running the recipe named there, ``hp`` around it, called directly."""
    handles = []
    for name, recipe in (swap or {}).items():
        lin = dict(model.named_modules())[name]
        plan = Plan(get_recipe(recipe), hp, scaled_mm=False)

        def forward(mod: nn.Module, args: Any, out: Any, plan: Plan = plan) -> torch.Tensor:
            return fp8_linear(args[0], mod.weight, mod.bias, plan).float()

        handles.append(lin.register_forward_hook(forward))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # the advisor's guard gives every pass the RNG state it found
    loss_fn(model, _batch()).backward()
    for h in handles:
        h.remove()
    return [p.grad.detach().clone() for p in model.parameters()]


def _noise(low: list[torch.Tensor], ref: list[torch.Tensor], keep: set[int]) -> float:
    return sum(
        float(((a.double() - b.double()) ** 2).sum())
        for i, (a, b) in enumerate(zip(low, ref, strict=True))
        if i in keep
    )


def _db(noise: float, ref: list[torch.Tensor]) -> float:
    signal = sum(float((r.double() ** 2).sum()) for r in ref)
    return math.inf if noise == 0 else -10 * math.log10(noise / signal)


# ---------------------------------------------------------------- the tests
def test_each_matmul_figure_is_that_matmul_alone_as_the_oracle_runs_it(advice: Any) -> None:
    """Each figure against the whole-model gradient error of a run with that matmul alone in
    the recipe (the recipe's Linear called directly): fprop with the module's input and output
    in bf16 as the policy has them, dgrad and wgrad with float32 around them. dgrad's draws of
    stochastic rounding come first in both; wgrad's follow dgrad's in the advisor's pass and
    not in the oracle's, hence a tolerance for nvfp4's wgrad."""
    model = _model()
    ref = _grads(model)
    everything = set(range(len(ref)))
    for row in advice.modules:
        for x in row.measurements:
            if x.matmuls is None:
                assert x.candidate == "bf16"  # a 16-bit candidate is measured whole
                continue
            recipe = get_recipe(x.candidate.replace("fp8:", "")).name
            runs = (
                _grads(model, {row.name: f"{recipe}/fp32/fp32"}),
                _grads(model, {row.name: f"fp32/{recipe}/fp32"}, torch.float32),
                _grads(model, {row.name: f"fp32/fp32/{recipe}"}, torch.float32),
            )
            want = [_db(_noise(run, ref, everything), ref) for run in runs]
            if row.name == "0":  # its input needs no gradient: no dgrad, no error of its own
                assert x.matmuls[1] == want[1] == math.inf
            for got, exp, matmul in zip(x.matmuls, want, ("fprop", "dgrad", "wgrad"), strict=True):
                tolerance = 0.3 if (recipe, matmul) == ("nvfp4", "wgrad") else 0.01
                assert got == pytest.approx(exp, abs=tolerance), (row.name, x.candidate, matmul)
            added = -10 * math.log10(sum(10 ** (-d / 10) for d in x.matmuls if d < math.inf))
            assert x.model_grad_sqnr == pytest.approx(added, abs=1e-9)


class Tied(nn.Module):
    """A head tied to its embedding (nanoGPT's lm_head): the head's weight gradient also holds
    what flows back through the embedding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 64)
        self.fc = nn.Linear(64, 64)
        self.head = nn.Linear(64, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.fc(self.emb(idx))))


def test_a_tied_module_s_dgrad_and_wgrad_are_measured_apart() -> None:
    """With the head's weight tied to the embedding, the error dgrad sends upstream lands on the
    head's own weight too: the split by where it landed would count it as wgrad's. Each gets a
    pass of its own instead (3 for the head and mxfp8), held to the runs with each alone."""
    model = Tied()
    tokens = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(2))
    batch = (tokens, torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(3)))

    def loss(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]).float().flatten(0, 1), b[1].flatten())

    advice = mixprec.advise(model, batch, loss, candidates=["mxfp8"], keep_at_most=0)
    assert advice.passes == 1 + 2 + 3 + 2  # fc: fprop, dgrad+wgrad; head: one pass each
    head = next(m for m in advice.modules if m.name == "head").measurements[0]
    ref = _tied_grads(model, batch, loss, None)
    for i, parts in ((1, "fp32/mxfp8/fp32"), (2, "fp32/fp32/mxfp8")):
        low = _tied_grads(model, batch, loss, parts)
        noise = _noise(low, ref, set(range(len(ref))))
        assert head.matmuls is not None
        assert head.matmuls[i] == pytest.approx(_db(noise, ref), abs=0.01), parts


def _tied_grads(model: nn.Module, batch: Any, loss: Any, parts: str | None) -> list[torch.Tensor]:
    handle = None
    if parts is not None:
        plan = Plan(get_recipe(parts), torch.float32, scaled_mm=False)

        def forward(mod: nn.Module, args: Any, out: Any) -> torch.Tensor:
            return fp8_linear(args[0], mod.weight, mod.bias, plan).float()

        handle = model.head.register_forward_hook(forward)
    model.zero_grad(set_to_none=True)
    loss(model, batch).backward()
    if handle is not None:
        handle.remove()
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "tensorwise"])
def test_dgrad_and_wgrad_errors_land_on_different_gradients(recipe: str) -> None:
    """The premise of the second pass, where the forward is exact (a float32 region: float32
    around the recipe): the module's own weight gradient holds wgrad's error alone, the
    gradients upstream dgrad's, and the ones downstream none."""
    model = _model(bias=False)
    ref = _grads(model)
    word = "fp8" if recipe == "tensorwise" else recipe
    for name, wgrad_only in (("2", f"fp32/fp32/{word}"), ("2", f"fp32/{word}/{word}")):
        region = mixprec.autocast(
            "cpu", torch.float32, policy=mixprec.Policy(modules={name: wgrad_only})
        )
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        with region:
            loss = loss_fn(model, _batch())
        loss.backward()
        got = [p.grad for p in model.parameters()]
        assert torch.equal(got[2], ref[2])  # downstream of the module: exact
        if wgrad_only.startswith("fp32/fp32"):
            assert torch.equal(got[0], ref[0])  # wgrad alone: nothing upstream moves
        else:
            assert not torch.equal(got[0], ref[0])  # dgrad reaches upstream
        assert not torch.equal(got[1], ref[1])  # the module's own weight: wgrad's error


def test_the_passes_stay_within_twice_the_per_module_count() -> None:
    common: dict[str, Any] = dict(candidates=CANDIDATES, keep_at_most=0)
    split = mixprec.advise(_model(), _batch(), loss_fn, **common)
    whole = mixprec.advise(_model(), _batch(), loss_fn, per_matmul=False, **common)
    linears = 3
    # reference, per module: 2 passes per recipe and 1 for bf16, the region, the cheapest
    assert split.passes == 1 + linears * (2 + 2 + 1) + 2
    assert whole.passes == 1 + linears * 3 + 2
    assert split.passes <= 2 * whole.passes
    assert split.per_matmul and not whole.per_matmul


def test_the_search_mixes_formats_per_matmul_and_the_policy_runs_them(advice: Any) -> None:
    mixes = [m for m in advice.modules if "/" in m.choice]
    assert advice.met and advice.predicted_sqnr >= 24.0
    assert mixes, advice.table()  # the target is between the recipes' figures
    for m in mixes:
        assert m.chosen is not None and m.chosen.matmuls is not None
        assert m.measurement(m.choice) is m.chosen
        rule = mixprec.Rule(m.choice)
        assert rule.matmuls is not None and len(set(rule.matmuls)) > 1
    model = _model()
    torch.manual_seed(5)
    measured = mixprec.advise(
        model, _batch(), loss_fn, candidates=CANDIDATES, min_sqnr=24.0, check=True
    )
    assert measured.policy == advice.policy
    assert measured.measured_sqnr == pytest.approx(measured.predicted_sqnr, abs=1.0)


def test_the_table_says_which_matmul_carries_the_error(advice: Any) -> None:
    text = advice.table()
    assert "per matmul: the model-grad SQNR" in text
    section = text.split("per matmul: the model-grad")[1]
    for m in advice.modules:
        line = next(x for x in section.splitlines() if x.startswith(m.name + " "))
        assert line.count("*") == 2  # the worst matmul of each recipe measured per matmul
    data = advice.to_dict()
    assert data["per_matmul"] is True
    row = data["modules"][0]
    assert len(row["measurements"][0]["matmuls"]) == 3 and row["gemms"]["calls"]


def test_per_matmul_false_measures_each_module_whole(advice: Any) -> None:
    whole = mixprec.advise(
        _model(), _batch(), loss_fn, candidates=CANDIDATES, min_sqnr=24.0, per_matmul=False
    )
    assert all(x.matmuls is None for m in whole.modules for x in m.measurements)
    assert all("/" not in m.choice for m in whole.modules)
    assert "per matmul:" not in whole.table()


def test_the_sqnr_objective_is_the_most_precise_policy_at_the_speedup() -> None:
    model, batch = _model(), (torch.randn(4096, 64), torch.randn(4096, 32))
    common: dict[str, Any] = dict(candidates=CANDIDATES, gpu="b200")
    fast = mixprec.advise(model, batch, loss_fn, objective="speed", min_sqnr=15.0, **common)
    assert fast.step is not None
    target = fast.step.speedup
    best = mixprec.advise(model, batch, loss_fn, objective="sqnr", min_speedup=target, **common)
    assert best.step is not None and best.met
    assert best.step.speedup >= target * (1 - 1e-9)
    assert best.predicted_sqnr >= fast.predicted_sqnr - 1e-9
    assert "at least" in best.table() and best.min_speedup == target
    slow = mixprec.advise(model, batch, loss_fn, objective="sqnr", min_speedup=100.0, **common)
    assert not slow.met
    assert any("speed target is out of reach" in n for n in slow.notes)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(objective="sqnr", gpu="b200"), "needs min_speedup"),
        (dict(objective="sqnr", min_speedup=1.5), "needs a GPU"),
        (dict(objective="speed", gpu="b200", min_speedup=1.5), 'goes with objective="sqnr"'),
        (dict(objective="sqnr", gpu="b200", min_speedup=0), "above 0"),
        (dict(per_matmul="yes"), "per_matmul must be True or False"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        mixprec.advise(_model(), _batch(), loss_fn, candidates=CANDIDATES, **kwargs)


def test_the_watch_measures_a_module_whose_matmuls_are_mixed(advice: Any) -> None:
    model = _model()
    watch = mixprec.Watch(model, loss_fn, advice, every=1, sample=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loop here trains under no policy at all
        report = watch.step(_batch())
    assert report is not None
    measured = {r.name: r.candidate for r in report.records}
    mixed = {m.name: m.choice for m in advice.modules if "/" in m.choice}
    assert mixed and all(measured[n] == c for n, c in mixed.items())


@pytest.mark.parametrize("objective", ["fewest_kept", "speed"])
def test_a_module_without_dgrad_gets_no_format_for_it(objective: str) -> None:
    """The first Linear's input needs no gradient: no dgrad runs, its figure is inf, and no
    option gives that matmul a format of its own (it follows fprop's)."""
    kwargs: dict[str, Any] = dict(candidates=["fp8", "mxfp8"], min_sqnr=20.0, objective=objective)
    if objective == "speed":
        kwargs["gpu"] = "h100"
    advice = mixprec.advise(_model(), _batch(), loss_fn, **kwargs)
    first = advice.modules[0]
    assert all(x.matmuls is not None and x.matmuls[1] == math.inf for x in first.measurements)
    from mixprec._src.advisor.choose.options import PerMatmul, module_choice

    choice = module_choice(
        "0",
        first.measurements,
        ("bf16", None, None),
        None,
        per_matmul=PerMatmul("bf16", BF16, None, torch.device("cpu")),
    )
    for option in choice.options:
        parts = mixprec.Rule(option.word).matmuls
        assert parts is None or parts[1] == parts[0], option.word


def test_no_mix_the_measuring_gpu_would_refuse_is_an_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU of compute capability 9.0 (simulated: the path's decision only), fp8 runs in
    hardware and mxfp8 would be emulated: a mix of the two is refused at the forward, so it is
    never an option; each with the region's dtype is."""
    from mixprec._src.advisor.choose.options import PerMatmul, module_choice
    from mixprec._src.devices import DeviceCaps
    from mixprec._src.fp8 import matmul as fp8_matmul
    from mixprec.types import Measurement

    row = DeviceCaps(fp8_scaled_mm=True, block_scaled_mm=True)
    monkeypatch.setattr(fp8_matmul, "caps", lambda device: row)
    monkeypatch.setattr(fp8_matmul, "_capability", lambda device: (9, 0))
    found = [
        Measurement(word, 30.0, 30.0, 30.0, 30.0, matmuls=(35.0, 36.0, 37.0))
        for word in ("fp8", "mxfp8")
    ]
    per = PerMatmul("bf16", BF16, None, torch.device("cpu"))
    words = [
        o.word
        for o in module_choice("m", found, ("bf16", None, None), None, per_matmul=per).options
    ]
    mixed = [w for w in words if "/" in w]
    assert "fp8/fp8/bf16" in mixed and "mxfp8/bf16/mxfp8" in mixed
    for w in mixed:
        parts = set(w.split("/")) - {"bf16"}
        assert len(parts) == 1, w  # never fp8 with mxfp8
