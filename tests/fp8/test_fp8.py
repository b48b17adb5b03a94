"""The fp8 package on its own: recipes against torchao.float8, non-finite values, stats, paths.

torchao.float8 (pinned, test-only) with ``emulate=True`` is the oracle: the same scale arithmetic
(amax upcast to float64, fp8_max / max(amax, 1e-12), optional power-of-two rounding), the same
saturating casts and the same fp32 emulated matmuls, so outputs and all gradients are compared
bit for bit.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections import Counter
from typing import Any

import pytest
import torch
from tests import fp8_oracle
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec._src import torch_compat
from mixprec._src.fp8 import matmul
from mixprec._src.fp8.casts import cast_stats, dequantize, quantize
from mixprec._src.fp8.formats import scale_from_amax
from mixprec._src.fp8.hook import Fp8Mode, Scope, can_serve, enter_module, exit_module
from mixprec._src.fp8.matmul import Plan, fp8_linear
from mixprec._src.fp8.recipes import E4M3, E5M2, RECIPES, Cast, get_recipe
from mixprec._src.fp8.stats import Fp8Stats
from mixprec.errors import ConfigError

float8 = pytest.importorskip("torchao.float8", reason="torchao is a test-only dependency")

TORCHAO_NAMES = {
    "tensorwise": "tensorwise",
    "rowwise": "rowwise",
    "rowwise_gw_hp": "rowwise_with_gw_hp",
}
FLOAT8 = list(TORCHAO_NAMES)  # the recipes torchao.float8 has (the block recipes: test_fp8_blocks)


def torchao_linear(lin: nn.Linear, recipe: str) -> nn.Module:
    config = float8.Float8LinearConfig.from_recipe_name(TORCHAO_NAMES[recipe])
    config = dataclasses.replace(config, emulate=True)
    return float8.convert_to_float8_training(nn.Sequential(copy.deepcopy(lin)), config=config)


def run(fn: Any, x: torch.Tensor, g: torch.Tensor, params: list[torch.Tensor]) -> list:
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(g)
    return [y, x.grad, *(p.grad for p in params)]


@pytest.mark.parametrize("hp", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", FLOAT8)
@pytest.mark.parametrize("ours", ["fp8_linear", "the harness's oracle"])
def test_bitwise_equal_to_torchao_emulated(recipe: str, hp: torch.dtype, ours: str) -> None:
    """fp8_linear, and the oracle of the #32 harness (tests/fp8_oracle.py), against torchao."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    ref = torchao_linear(lin, recipe)
    x = (torch.randn(4, 8, 64) * 3).to(hp)
    x[1, 2] *= 100  # an outlier row: rowwise and tensorwise scales differ
    g = torch.randn(4, 8, 48).to(hp) * 1e-3
    want = run(ref, x, g, [ref[0].weight, ref[0].bias])
    plan = Plan(get_recipe(recipe), hp, scaled_mm=False)

    def linear(t: torch.Tensor) -> torch.Tensor:
        if ours == "fp8_linear":
            return fp8_linear(t, lin.weight, lin.bias, plan)
        return fp8_oracle.linear(t, lin.weight, lin.bias, recipe, hp)

    got = run(linear, x, g, [lin.weight, lin.bias])
    for name, a, b in zip(
        ("output", "grad_input", "grad_weight", "grad_bias"), got, want, strict=True
    ):
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), f"{recipe}/{hp}: {name} differs from torchao"


def test_recipes_are_torchaos() -> None:
    """The six casts of each recipe are torchao's: format, granularity, power-of-two scales."""
    fields = {
        "x": "input",
        "w": "weight",
        "dy_gi": "grad_output",
        "w_gi": "weight_for_grad_input",
        "dy_gw": "grad_output_for_grad_weight",
        "x_gw": "input_for_grad_weight",
    }
    for name in FLOAT8:
        recipe = RECIPES[name]
        config = float8.Float8LinearConfig.from_recipe_name(TORCHAO_NAMES[name])
        for ours, theirs in fields.items():
            cc = getattr(config, f"cast_config_{theirs}")
            cast = getattr(recipe, ours)
            if cc.scaling_type is float8.ScalingType.DISABLED:
                assert cast is None, (name, ours)
                continue
            assert cast is not None, (name, ours)
            assert cast.dtype == cc.target_dtype, (name, ours)
            rowwise = cc.scaling_granularity is float8.ScalingGranularity.AXISWISE
            assert cast.block == ((1, 0) if rowwise else (0, 0)), (name, ours)
            assert (cast.scale == "pow2") == config.round_scales_to_power_of_2, (name, ours)


def test_recipe_names() -> None:
    assert get_recipe("").name == "tensorwise"
    assert get_recipe("rowwise_with_gw_hp").name == "rowwise_gw_hp"
    with pytest.raises(ConfigError, match='"fp8:rowwise"'):
        get_recipe("rowise")


def test_scale_edge_cases() -> None:
    e4 = Cast(E4M3)
    zero = scale_from_amax(torch.tensor(0.0), e4)
    assert torch.isfinite(zero) and zero == 448 / 1e-12  # all-zero tensor: finite scale
    assert scale_from_amax(torch.tensor(float("inf")), e4) == 0
    assert torch.isnan(scale_from_amax(torch.tensor(float("nan")), e4))
    pow2 = scale_from_amax(torch.tensor(3.0), Cast(E4M3, scale="pow2"))
    assert pow2 == 128  # 448/3 = 149.3, rounded down to a power of two
    q, _ = quantize(torch.zeros(1, 3), e4, 1)
    assert torch.equal(dequantize(q, e4), torch.zeros(1, 3))


# ---------------------------------------------------------------- never silent
def test_a_plain_cast_would_hide_or_mangle_an_overflow() -> None:
    """The premise of the tests below: a plain e4m3 cast keeps no inf. torch 2.13 on saturates
    inf and anything past 464 to 448 (the overflow is hidden); 2.12 turns them into NaN, and with
    them any finite value past 464. mixprec's casts depend on neither: the scale brings every
    finite value within 448 and turns inf into NaN, so the tests below hold on both."""
    x = torch.tensor([float("inf"), -float("inf"), 1e6, 463.0])
    got = x.to(E4M3).float().tolist()
    if torch_compat.TORCH_RELEASE >= (2, 13):
        assert got == [448.0, -448.0, 448.0, 448.0]
    else:
        assert [math.isnan(v) for v in got] == [True, True, True, False] and got[3] == 448.0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_nonfinite_input_stays_visible(recipe: str, bad: float) -> None:
    """Every recipe, blocks included (128 features: every block recipe's multiple)."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 128)
    x = torch.randn(6, 128, requires_grad=True)
    with torch.no_grad():
        x[2, 5] = bad
    plan = Plan(get_recipe(recipe), torch.float32, scaled_mm=False)
    y = fp8_linear(x, lin.weight, lin.bias, plan)
    bad_rows = (~torch.isfinite(y)).any(dim=1)
    cast = get_recipe(recipe).x
    assert cast is not None
    if cast.block[0] == 1 and cast.scale != "e4m3_fp32":  # scales per row or row block
        assert bad_rows.tolist() == [i == 2 for i in range(6)]  # only that row
    else:
        assert bad_rows.all()  # a scale for the tensor (NVFP4's too): everything
    y.sum().backward()
    assert not torch.isfinite(lin.weight.grad).all()  # type: ignore[arg-type]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_nonfinite_gradient_stays_visible(recipe: str) -> None:
    lin = nn.Linear(128, 128)
    x = torch.randn(6, 128, requires_grad=True)
    y = fp8_linear(x, lin.weight, lin.bias, Plan(get_recipe(recipe), torch.float16, False))
    g = torch.ones_like(y)
    g[0, 0] = float("inf")  # e.g. an fp16 loss overflow upstream
    y.backward(g)
    assert not torch.isfinite(x.grad).all()  # type: ignore[arg-type]
    assert not torch.isfinite(lin.weight.grad).all()  # type: ignore[arg-type]


# ---------------------------------------------------------------- stats
def test_cast_stats_counts() -> None:
    x = torch.tensor([[1e-12, 1.0, 0.0, -1.0, 0.5]])
    cast = Cast(E5M2)
    q, src = quantize(x, cast, 1)
    row = cast_stats(src, q, cast, True, 5).tolist()
    # amax 1, scale 57344 (smallest and largest: one scale), two elements at the max, 1e-12
    # flushed (below e5m2's subnormals), nothing non-finite, 5 elements, 1 block, not clamped
    assert row == [1.0, 57344.0, 57344.0, 2.0, 1.0, 0.0, 5.0, 1.0, 0.0, 0.0]


def _three_layer() -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    tokens: list[Any] = []

    def pre(mod: nn.Module, args: Any) -> None:
        name = "0" if mod is model[0] else "2"
        tokens.append(enter_module(mod, name, get_recipe("rowwise"), torch.float32))

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        exit_module(tokens.pop())

    for m in (model[0], model[2]):
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
    return model, tokens


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def test_stats_per_module_without_host_sync() -> None:
    model, _ = _three_layer()
    x = torch.randn(4, 16)
    x[0, 0] = float("inf")
    stats = Fp8Stats()
    with CountOps() as counted:
        with stats:
            loss = model(x).sum()
        loss.backward()
    assert counted.ops["_local_scalar_dense"] == 0  # no host sync while recording
    assert stats.names == ["0", "2"]
    read = stats.read()
    first = read["0"]
    assert first.recipe == "rowwise"
    assert first.input.nonfinite == 1 and first.input.amax == float("inf")
    assert first.input.elements == 2 * x.numel()  # rowwise: cast for output and grad_weight
    # x needs no gradient: the first weight is cast for the output matmul only
    assert first.weight.elements == 16 * 32 and first.weight.nonfinite == 0
    assert read["2"].weight.elements == 2 * 32 * 8
    assert read["2"].grad_output.elements == 2 * 4 * 8
    assert 0 <= first.weight.saturated <= 1 and first.weight.flushed == 0
    assert "grad_output" in stats.summary()
    assert stats.tensor("0").shape == (3, 10)
    stats.reset()
    assert stats.read() == {}


# ---------------------------------------------------------------- paths
def test_cpu_never_takes_scaled_mm() -> None:
    """On the CPU torch._scaled_mm is oneDNN's reference kernel (thousands of times slower)."""
    assert not matmul.use_scaled_mm(torch.device("cpu"))
    model, _ = _three_layer()
    with CountOps() as counted:
        model(torch.randn(32, 16, requires_grad=True)).sum().backward()
    assert counted.ops["_scaled_mm"] == 0
    assert counted.ops["mm"] == 6  # the emulated matmuls ran (3 per Linear)


@pytest.mark.parametrize("recipe", FLOAT8)
def test_scaled_mm_path_matches_emulation(recipe: str) -> None:
    """The path CUDA users take, exercised on the CPU with tiny aligned shapes."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 48)
    x, g = torch.randn(16, 32), torch.randn(16, 48)
    emulated = run(
        lambda t: fp8_linear(t, lin.weight, None, Plan(get_recipe(recipe), torch.bfloat16, False)),
        x,
        g,
        [lin.weight],
    )
    lin.weight.grad = None
    with CountOps() as counted:
        fast = run(
            lambda t: fp8_linear(
                t, lin.weight, None, Plan(get_recipe(recipe), torch.bfloat16, True)
            ),
            x,
            g,
            [lin.weight],
        )
    assert counted.ops["_scaled_mm"] == (2 if recipe == "rowwise_gw_hp" else 3)
    for a, b in zip(fast, emulated, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)


def test_mode_serves_only_its_weight() -> None:
    assert can_serve(nn.Linear) and can_serve(nn.modules.linear.NonDynamicallyQuantizableLinear)
    assert not can_serve(nn.Conv2d) and not can_serve(nn.Bilinear)
    lin, other = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(2, 4)
    want_other, want_lin = other(x), lin(x)
    scope = Scope("lin", get_recipe("tensorwise"), torch.float32, None, False)
    with Fp8Mode(list(lin.parameters()), lambda: scope):  # follows lin's weights only (#32)
        assert torch.equal(other(x), want_other)
        assert not torch.equal(lin(x), want_lin)
    assert scope.served == 1


def test_gpu_check_fp8_section_runs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU script's fp8 check, its _scaled_mm route forced on for the recipes torch's CPU
    _scaled_mm runs (tiny aligned shapes; the block kernels' layouts: test_fp8_blocks)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_fp8", path)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    rows, ok = gpu_check.fp8_check(torch.device("cpu"), 128, 128, 256)
    table = "\n".join(rows)
    assert ok and "| tensorwise | False | emulated | 0 |" in table  # the CPU: emulation only
    assert "| nvfp4 | False | emulated | 0 |" in table
    monkeypatch.setattr(matmul, "use_scaled_mm", lambda device, recipe=None: not recipe.blocked)
    rows, ok = gpu_check.fp8_check(torch.device("cpu"), 128, 128, 256)
    table = "\n".join(rows)
    assert ok, rows
    assert "| rowwise | True | hardware | 3 |" in table
    assert "| rowwise_gw_hp | True | hardware | 2 |" in table
    assert "| mxfp8 | False | emulated | 0 |" in table


def test_bench_fp8_prints_its_tables(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/bench_fp8.py runs (tiny sizes, eager only; nothing here measures speed)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_fp8.py"
    spec = importlib.util.spec_from_file_location("bench_fp8", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--width", "128", "--batch", "32", "--rounds", "1", "--no-compile"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    for recipe in RECIPES:
        assert f"| mixprec {recipe}" in out
    for recipe in bench.TORCHAO_NAME:
        assert f"| torchao {recipe}" in out
    assert out.count("| eager ") == 2 + len(RECIPES) + len(bench.TORCHAO_NAME)
    for recipe in bench.TORCHAO_NAME:  # mixprec's time over torchao's, per recipe
        assert re.search(rf"^- eager {recipe}: \d+\.\d\dx \((met|NOT met)\)$", out, re.M)
