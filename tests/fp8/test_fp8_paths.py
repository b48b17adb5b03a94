"""Which path the low-precision matmuls take (hardware or emulated), how it is seen, and the
emulation's own pieces: the fp8 codes widened to fp32, nvfp4's stochastic rounding seeded by
torch's generator."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec._src.fp8 import matmul
from mixprec._src.fp8.formats import widen
from mixprec._src.fp8.recipes import RECIPES, rule_word
from mixprec.errors import ConfigError

WORDS = [rule_word(name) for name in RECIPES]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_widen_is_torchs_conversion_bit_for_bit(dtype: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    ours, theirs = widen(codes), codes.to(torch.float32)
    assert ours.dtype == torch.float32
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))  # NaN and -0 included
    grid = codes.reshape(16, 16).t()  # any layout: a transposed view
    assert torch.equal(widen(grid).view(torch.int32), grid.float().view(torch.int32))


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("word", WORDS)
def test_the_cpu_path_is_emulated_and_says_so(word: str) -> None:
    """No ``_scaled_mm`` of any kind on the CPU (oneDNN's reference kernel there): fp32 matmuls
    of the dequantized values, and ``matmul_path`` and ``Fp8Stats`` say "emulated"."""
    assert mixprec.matmul_path(word, "cpu") == "emulated"
    assert mixprec.matmul_path(word, torch.device("cpu")) == "emulated"
    model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128))
    stats = mixprec.Fp8Stats()
    with CountOps() as counted:
        with stats, mixprec.autocast("cpu", torch.bfloat16, policy=f"nn.Linear={word}"):
            out = model(torch.randn(32, 128, requires_grad=True))
        out.float().sum().backward()
    assert not [op for op in counted.ops if "scaled_mm" in op], counted.ops
    assert counted.ops["mm"] == 6  # three emulated matmuls per Linear
    assert {s.path for s in stats.read().values()} == {"emulated"}


# (capability, the recipes with a hardware path there)
TABLE = [
    ((8, 0), set()),
    ((8, 9), {"tensorwise", "rowwise", "rowwise_gw_hp"}),
    ((9, 0), {"tensorwise", "rowwise", "rowwise_gw_hp", "blockwise"}),
    ((10, 0), {"tensorwise", "rowwise", "rowwise_gw_hp", "mxfp8", "nvfp4"}),
    ((12, 0), {"tensorwise", "rowwise", "rowwise_gw_hp", "mxfp8", "nvfp4"}),
]


@pytest.mark.parametrize(("capability", "hardware"), TABLE)
def test_the_device_table_gates_each_recipe_by_compute_capability(
    capability: tuple[int, int], hardware: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA each recipe takes torch's kernel in its capability range and the emulation
    elsewhere; a device type without fp8 kernels is emulated whatever it reports."""
    monkeypatch.setattr(matmul, "_capability", lambda device: capability)
    for name in RECIPES:
        want = "hardware" if name in hardware else "emulated"
        assert mixprec.matmul_path(rule_word(name), "cuda:0") == want, name
        assert mixprec.matmul_path(rule_word(name), "xpu") == "emulated"
        assert mixprec.matmul_path(rule_word(name), "cpu") == "emulated"


def test_matmul_path_reads_rule_words_as_policies_do() -> None:
    assert mixprec.matmul_path(" FP8:Rowwise_With_GW_HP @fp32", "cpu") == "emulated"
    for bad in ("bf16", "fp8:nope", "mxfp8:rowwise", "", 8):
        with pytest.raises(ConfigError, match=r"fp8-family|rule word"):
            mixprec.matmul_path(bad, "cpu")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not a device"):
        mixprec.matmul_path("fp8", "gpu0")


def _nvfp4_grads(seed: int | None, x: torch.Tensor, model: nn.Module) -> list[torch.Tensor]:
    if seed is not None:
        torch.manual_seed(seed)
    for p in model.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    with mixprec.autocast("cpu", torch.bfloat16, policy="nn.Linear=nvfp4"):
        out = model(x)
    out.float().square().mean().backward()
    weights = [m.weight.grad for m in model.modules() if isinstance(m, nn.Linear)]
    return [x.grad, *weights]  # type: ignore[list-item]


def test_nvfp4_stochastic_rounding_is_seeded_by_torch_manual_seed() -> None:
    """The gradients' stochastic rounding draws from torch's generator of the device, as dropout
    does: the same seed gives the same bits, another seed other bits (the input's and the
    weights' gradients; a bias gradient is the sum of the exact grad_output)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    x = torch.randn(32, 64)
    first, again, other = (_nvfp4_grads(s, x, model) for s in (5, 5, 6))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert all(not torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_nvfp4_gradients_are_unbiased_over_seeds() -> None:
    """Averaged over seeds, the stochastically rounded grad_input tends to the one computed from
    the exact grad_output (the weight still cast): its error shrinks as 1/sqrt(draws), where a
    round-to-nearest cast would keep its bias."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    x = torch.randn(64, 64)
    g = torch.randn(64, 32)
    plan = matmul.Plan(RECIPES["nvfp4"], torch.float32, scaled_mm=False)
    qw, _ = matmul.quantize(lin.weight.detach(), RECIPES["nvfp4"].w_gi, 0)
    exact = g @ matmul.dequantize(qw, RECIPES["nvfp4"].w_gi)  # dy not cast
    draws = []
    for seed in range(64):
        torch.manual_seed(seed)
        xi = x.clone().requires_grad_()
        matmul.fp8_linear(xi, lin.weight, None, plan).backward(g)
        draws.append(xi.grad)

    def err(t: torch.Tensor) -> float:
        return float((t - exact).norm() / exact.norm())

    one, mean = err(draws[0]), err(torch.stack(draws).mean(0))
    # 64 draws: 1/8 of one draw's error if unbiased; 1/4 leaves room for the clamp at +-6
    assert mean < one / 4, (one, mean)
