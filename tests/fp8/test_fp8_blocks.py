"""The block-scaled recipes (MXFP8, DeepSeek-style 128-blocks, NVFP4) against their oracles.

- MXFP8: outputs and all gradients bit for bit torchao 0.18's emulated MXFP8 training
  (``MXFP8TrainingOpConfig.from_recipe(MXFP8_EMULATED_RCEIL)`` through ``quantize_``) on the same
  bias-free Linear, directly and through the ``"mxfp8"`` rule (eager, compiled, checkpointed).
- NVFP4: the casts bit for bit ``NVFP4Tensor.to_nvfp4(...).dequantize()`` with a tensor scale;
  the e2m1 rounding bit for bit torchao's; the Linear against a reference written here from the
  paper's recipe (2D weight blocks, Hadamard on the grad_weight inputs, stochastic rounding of
  the gradients).
- 128-blocks: the casts and the Linear against a reference written here, tile by tile, from the
  DeepSeek-V3 description (scale = amax / 448 per 1x128 tile or 128x128 block, fp32, not a power
  of two).
- The hardware path's argument layouts, on the CPU, through a stand-in for ``F.scaled_mm`` that
  checks what torch's CUDA kernels check and computes what they compute.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec
from mixprec._src.fp8 import kernels
from mixprec._src.fp8.casts import dequantize, quantize
from mixprec._src.fp8.formats import hadamard, round_e2m1
from mixprec._src.fp8.matmul import Plan, fp8_linear
from mixprec._src.fp8.recipes import E2M1, E4M3, Cast, get_recipe
from mixprec.errors import ConfigError

pytest.importorskip("torchao", reason="torchao is a test-only dependency")
from torchao.prototype.moe_training.config import (
    MXFP8TrainingOpConfig,
    MXFP8TrainingRecipe,
)
from torchao.prototype.mx_formats.kernels import (
    f4_unpacked_to_f32,
    f32_to_f4_unpacked,
    pack_uint4,
)
from torchao.prototype.mx_formats.nvfp4_tensor import (
    NVFP4Tensor,
    per_tensor_amax_to_scale,
)
from torchao.prototype.mx_formats.utils import to_blocked
from torchao.quantization import quantize_

BLOCK_RECIPES = ("blockwise", "mxfp8", "nvfp4")


def torchao_mxfp8(lin: nn.Linear) -> nn.Linear:
    ref = copy.deepcopy(lin)
    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    quantize_(ref, config, filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear))
    return ref


def run(fn: Any, x: torch.Tensor, g: torch.Tensor, params: list[torch.Tensor]) -> list:
    for p in params:
        p.grad = None
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(g)
    return [y, x.grad, *(p.grad for p in params)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(s.dtype == t.dtype and torch.equal(s, t) for s, t in zip(a, b, strict=True))


def outliers(shape: tuple[int, ...]) -> torch.Tensor:
    x = torch.randn(*shape) * 3
    x.view(-1, shape[-1])[3] *= 100  # an outlier token: its blocks get their own scales
    x.view(-1, shape[-1])[5, :40] = 0  # an all-zero block
    return x


# ---------------------------------------------------------------- MXFP8 against torchao
@pytest.mark.parametrize("shape", [(64, 128, 256), (2, 48, 64, 32)])
def test_mxfp8_is_bitwise_torchaos_emulated_training(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    *lead, k, n = shape
    lin = nn.Linear(k, n, bias=False)
    ref = torchao_mxfp8(lin)
    x, g = outliers((*lead, k)), torch.randn(*lead, n)
    want = run(ref, x, g, [ref.weight])
    plan = Plan(get_recipe("mxfp8"), torch.float32, scaled_mm=False)
    got = run(lambda t: fp8_linear(t, lin.weight, None, plan), x, g, [lin.weight])
    assert same(got, want)
    assert not torch.equal(got[0], x @ lin.weight.t())  # the recipe changed the numerics


def _rule_step(
    model: nn.Module, x: torch.Tensor, word: str, wrap: Any = None
) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(0)
    with mixprec.autocast("cpu", torch.bfloat16, policy=f"nn.Linear={word}"):
        out = model(x) if wrap is None else wrap(model, x)
    out.float().square().mean().backward()
    return [out, x.grad, *(p.grad for p in model.parameters())]


def _by_hand(model: nn.Sequential, x: torch.Tensor, recipe: str) -> list[torch.Tensor]:
    """The rule's computation written out: each Linear through the fp8 Linear (bf16 around)."""
    for p in model.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(0)
    plan = Plan(get_recipe(recipe), torch.bfloat16, scaled_mm=False)
    h = F.gelu(fp8_linear(x, model[0].weight, None, plan))
    out = fp8_linear(h, model[2].weight, None, plan)
    out.float().square().mean().backward()
    return [out, x.grad, *(p.grad for p in model.parameters())]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(128, 256, bias=False), nn.GELU(), nn.Linear(256, 128, bias=False)
    )


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_the_rule_is_the_fp8_linear_eager_checkpointed_and_compiled(recipe: str) -> None:
    """The rule runs exactly the function the oracles above check (the fp32 region is off, so
    the rule is compared at bf16 with the same function by hand), under activation checkpointing
    and torch.compile too."""
    model, x = _mlp(), outliers((48, 128))
    word = str(mixprec.Rule(recipe if recipe != "blockwise" else "fp8:blockwise"))
    eager = _rule_step(model, x, word)
    assert same(eager, _by_hand(model, x, recipe))
    for reentrant in (False, True):
        wrap = lambda m, t, r=reentrant: checkpoint(m, t, use_reentrant=r)  # noqa: E731
        ckpt = _rule_step(model, x, word, wrap)
        assert same(ckpt, eager), reentrant
    torch._dynamo.reset()
    with mixprec.autocast("cpu", torch.bfloat16, policy=f"nn.Linear={word}"):
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(model, backend="aot_eager")
    assert same(_rule_step(compiled, x, word), eager)


def test_torchaos_emulated_mxfp8_linear_drops_the_bias() -> None:
    """What docs/fp8.md says about torchao 0.18: its MXFP8 weight wrapper's ``linear`` override
    (``MXFP8TrainingWeightWrapperTensor.__torch_function__``) calls the MX matmul on
    ``(input, weight)`` and never adds ``args[2]``: the output is the bias-free one and the bias
    gets no gradient. mixprec adds the bias in high precision, as nn.Linear does."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 256)
    ref = torchao_mxfp8(lin)
    x = torch.randn(64, 128)
    out = ref(x.clone().requires_grad_())
    no_bias = torchao_mxfp8(nn.Linear(128, 256, bias=False))
    no_bias.weight = ref.weight
    assert torch.equal(out, no_bias(x))
    out.sum().backward()
    assert ref.bias.grad is None
    plan = Plan(get_recipe("mxfp8"), torch.float32, scaled_mm=False)
    ours = fp8_linear(x, lin.weight, lin.bias, plan)
    assert torch.equal(ours, fp8_linear(x, lin.weight, None, plan) + lin.bias)


def test_torchaos_emulated_mxfp8_refuses_a_bf16_input_beside_fp32_weights() -> None:
    """The other torchao 0.18 failure docs/fp8.md names: its emulated MX matmul dequantizes each
    operand to its own original dtype, then calls ``torch.mm`` on a bf16 and an fp32 tensor."""
    ref = torchao_mxfp8(nn.Linear(64, 32, bias=False))
    with pytest.raises(RuntimeError, match="same dtype"):
        ref(torch.randn(32, 64).bfloat16())
    with mixprec.autocast("cpu", torch.bfloat16, policy="nn.Linear=mxfp8"):
        assert nn.Linear(64, 32)(torch.randn(32, 64)).dtype == torch.bfloat16


# ---------------------------------------------------------------- NVFP4 against torchao
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_casts_are_torchaos(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = (torch.randn(64, 128) * 2).to(dtype)
    x[5, :16] *= 1000  # one block far above the rest
    x[7, 16:32] = 0  # an all-zero block
    x[9, 32:48] *= 1e-6  # a block whose E4M3 scale is clamped to its smallest normal
    scale = per_tensor_amax_to_scale(x.float().abs().max())
    theirs = NVFP4Tensor.to_nvfp4(x.contiguous(), per_tensor_scale=scale)
    cast = Cast(E2M1, block=(1, 16), scale="e4m3_fp32")
    q, _ = quantize(x, cast, 1)
    assert torch.equal(dequantize(q, cast), theirs.dequantize(torch.float32))
    assert torch.equal(q.scale.reshape(64, 8).view(torch.uint8), theirs.scale.view(torch.uint8))
    assert torch.equal(q.tensor_scale, scale)


def test_e2m1_rounding_is_torchaos_including_ties() -> None:
    grid = torch.linspace(-6, 6, 4801)  # steps of 1/400: every tie of every binade is on it
    theirs = f4_unpacked_to_f32(f32_to_f4_unpacked(grid))
    assert torch.equal(round_e2m1(grid), theirs)
    packed = kernels.pack_e2m1(round_e2m1(grid[:4800]).reshape(-1, 2 * 50))
    assert torch.equal(
        packed.view(torch.uint8), pack_uint4(f32_to_f4_unpacked(grid[:4800])).reshape(48, 50)
    )


def test_stochastic_rounding_is_unbiased_and_reproducible() -> None:
    v = torch.full((200_000,), 2.3)
    r = round_e2m1(v, stochastic=True, gen=torch.Generator().manual_seed(0))
    assert set(r.unique().tolist()) == {2.0, 3.0}
    assert abs(r.mean().item() - 2.3) < 0.01  # E[round(v)] = v; 0.01 is 9 standard errors
    assert torch.equal(r, round_e2m1(v, stochastic=True, gen=torch.Generator().manual_seed(0)))
    lin, x, g = nn.Linear(64, 32), torch.randn(16, 64, requires_grad=True), torch.randn(16, 32)
    plan = Plan(get_recipe("nvfp4"), torch.float32, scaled_mm=False)
    grads = []
    for state in (7, 7, 8):  # torch's generator, as dropout: torch.manual_seed repeats a run
        torch.manual_seed(state)
        lin.weight.grad = None
        fp8_linear(x, lin.weight, lin.bias, plan).backward(g)
        grads.append(lin.weight.grad.clone())
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])


def test_hadamard_is_orthogonal_and_spreads_an_outlier() -> None:
    a = torch.randn(64, 8, dtype=torch.float64).float()
    b = torch.randn(64, 5)
    torch.testing.assert_close(hadamard(a, 0).t() @ hadamard(b, 0), a.t() @ b, rtol=1e-5, atol=1e-5)
    spike = torch.zeros(16, 1)
    spike[3] = 16.0
    assert torch.equal(hadamard(spike, 0).abs(), torch.full((16, 1), 4.0))
    assert torch.equal(hadamard(spike.t(), 1), hadamard(spike, 0).t())


def _nvfp4_tile(tile: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """One NVFP4 block, from the paper's two-level formula: decode scale amax / 6 stored in
    E4M3 relative to the fp32 tensor scale, elements rounded to e2m1 (to nearest)."""
    stored = ((tile.abs().max() / 6.0) / tensor_scale).clamp(2**-6, 448.0).to(E4M3).float()
    values = round_e2m1(torch.clamp(tile * ((1.0 / tensor_scale) / stored), -6.0, 6.0))
    return values * (tensor_scale * stored)


def _nvfp4_reference(
    x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, gen: torch.Generator
) -> list[torch.Tensor]:
    """The NVFP4 paper's Linear, written from its description: 1x16 blocks along each
    contraction dimension (torchao's ``NVFP4Tensor`` casts them), 16x16 blocks for the weight
    (tile by tile here), stochastic rounding for the gradients (the generator's draws taken in
    mixprec's order, by its quantizer), the Hadamard transform on both grad_weight inputs."""

    def tensor_scale(t: torch.Tensor) -> torch.Tensor:
        return per_tensor_amax_to_scale(t.abs().max().clamp(min=1e-12))

    def q(t: torch.Tensor) -> torch.Tensor:  # 1x16 along dim 1, to nearest
        nv = NVFP4Tensor.to_nvfp4(t.contiguous(), per_tensor_scale=tensor_scale(t))
        return nv.dequantize(torch.float32)

    def q_sr(t: torch.Tensor, dim: int) -> torch.Tensor:  # 1x16 along dim, stochastic
        cast = Cast(E2M1, block=(1, 16), scale="e4m3_fp32", stochastic=True)
        return dequantize(quantize(t, cast, dim, gen)[0], cast)

    def q2d(t: torch.Tensor) -> torch.Tensor:
        out, ts = torch.empty_like(t), tensor_scale(t)
        for i in range(0, t.shape[0], 16):
            for j in range(0, t.shape[1], 16):
                out[i : i + 16, j : j + 16] = _nvfp4_tile(t[i : i + 16, j : j + 16], ts)
        return out

    wq = q2d(w)
    out = q(x) @ wq.t()
    dx = q_sr(dy, 1) @ wq
    dw = q_sr(hadamard(dy, 0), 0).t() @ q(hadamard(x, 0).t()).t()
    return [out, dx, dw]


def test_nvfp4_weight_blocks_are_16x16_and_torchaos_within_a_row_block() -> None:
    """A 16x16 block whose 16 rows share one amax casts as torchao's 1x16 blocks do."""
    w = torch.randn(16, 64)
    w[:, ::16] = 5.0  # every 1x16 row block has the 16x16 block's amax
    cast = Cast(E2M1, block=(16, 16), scale="e4m3_fp32")
    q, _ = quantize(w, cast, 1)
    scale = per_tensor_amax_to_scale(w.abs().max())
    theirs = NVFP4Tensor.to_nvfp4(w, per_tensor_scale=scale).dequantize(torch.float32)
    assert torch.equal(dequantize(q, cast), theirs)
    assert q.scale.numel() == 4  # one scale per 16x16 block


def test_nvfp4_linear_is_the_papers_recipe() -> None:
    torch.manual_seed(0)
    x, w, dy = outliers((48, 64)), torch.randn(32, 64) * 0.1, torch.randn(48, 32) * 1e-3
    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(3)  # the same stream as torch's after manual_seed(3)
    plan = Plan(get_recipe("nvfp4"), torch.float32, scaled_mm=False)
    weight = w.clone().requires_grad_()
    got = run(lambda t: fp8_linear(t, weight, None, plan), x, dy, [weight])
    want = _nvfp4_reference(
        x, w, dy, gen
    )  # draws in the same order: grad_input's, then grad_weight's
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------- 128-blocks (DeepSeek-V3)
def deepseek_qdq(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """DeepSeek-V3's fine-grained quantization, tile by tile: per 1x128 tile (activations,
    gradients) or 128x128 block (weights), scale = max|tile| / 448 in fp32 (no power-of-two
    rounding; the amax floored at 1e-12 so an all-zero tile stays zero), e4m3 = tile / scale
    (saturating), dequantized as e4m3 * scale."""
    out = torch.empty_like(x, dtype=torch.float32)
    r, c = tile
    for i in range(0, x.shape[0], r):
        for j in range(0, x.shape[1], c):
            t = x[i : i + r, j : j + c].float()
            s = t.abs().max().clamp(min=1e-12) / 448.0
            out[i : i + r, j : j + c] = (t / s).to(torch.float8_e4m3fn).float() * s
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_casts_are_deepseeks(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = outliers((64, 256)).to(dtype)
    w = (torch.randn(256, 128) * 0.05).to(dtype)
    recipe = get_recipe("blockwise")
    assert recipe.x is not None and recipe.w is not None and recipe.dy_gw is not None
    for t, cast, dim, tile in (
        (x, recipe.x, 1, (1, 128)),  # the input of the output matmul: 1x128 along K
        (w, recipe.w, 1, (128, 128)),
        (x, recipe.dy_gw, 0, (128, 1)),  # an operand of the grad_weight matmul: along tokens
    ):
        q, _ = quantize(t if dim == 1 else F.pad(t, (0, 0, 0, 64)), cast, dim)
        want = deepseek_qdq(t if dim == 1 else F.pad(t, (0, 0, 0, 64)), tile)
        assert torch.equal(dequantize(q, cast), want)


def test_blockwise_linear_is_deepseeks() -> None:
    torch.manual_seed(0)
    x, dy = outliers((100, 128)), torch.randn(100, 256) * 1e-3
    w = torch.randn(256, 128) * 0.05
    weight = w.clone().requires_grad_()
    plan = Plan(get_recipe("blockwise"), torch.float32, scaled_mm=False)
    got = run(lambda t: fp8_linear(t, weight, None, plan), x, dy, [weight])
    wq = deepseek_qdq(w, (128, 128))
    xp, dyp = F.pad(x, (0, 0, 0, 28)), F.pad(dy, (0, 0, 0, 28))  # 100 tokens padded to 128
    want = [
        deepseek_qdq(x, (1, 128)) @ wq.t(),
        deepseek_qdq(dy, (1, 128)) @ wq,
        deepseek_qdq(dyp, (128, 1)).t() @ deepseek_qdq(xp, (128, 1)),
    ]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------- every block recipe
@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_tokens_are_padded_exactly(recipe: str) -> None:
    """40 tokens give what the same 40 tokens plus zero rows give (the padding's effect)."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 128)
    x, g = torch.randn(40, 128), torch.randn(40, 128)
    plan = Plan(get_recipe(recipe), torch.float32, scaled_mm=False)
    torch.manual_seed(0)
    got = run(lambda t: fp8_linear(t, lin.weight, None, plan), x, g, [lin.weight])
    torch.manual_seed(0)
    pad = 256 - 40  # a multiple of every recipe's token block
    padded = run(
        lambda t: fp8_linear(t, lin.weight, None, plan),
        F.pad(x, (0, 0, 0, pad)),
        F.pad(g, (0, 0, 0, pad)),
        [lin.weight],
    )
    assert torch.equal(got[0], padded[0][:40]) and torch.equal(got[1], padded[1][:40])
    if recipe != "nvfp4":  # nvfp4's stochastic draws depend on the padded length
        assert torch.equal(got[2], padded[2])


@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_features_not_a_multiple_of_the_block_are_refused_naming_the_module(recipe: str) -> None:
    model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))
    word = mixprec.Rule(f"fp8:{recipe}" if recipe == "blockwise" else recipe)
    refused = pytest.raises(ConfigError, match=r"Linear '2' \(in_features=128, out_features=8\)")
    with refused, mixprec.autocast("cpu", torch.bfloat16, policy=f"nn.Linear={word}"):
        model(torch.randn(4, 128))
    with mixprec.autocast("cpu", torch.bfloat16, policy=f"nn.Linear={word}, 2=bf16"):
        assert model(torch.randn(4, 128)).shape == (4, 8)


# ---------------------------------------------------------------- the hardware path's layouts
def _unblocked(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of cuBLAS's swizzle, written from its description: tile (i, j) of 128x4 is 512
    consecutive entries; within it, row r = 32 * a + b and column c sit at 16 * b + 4 * a + c."""
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = torch.empty(pr, pc, dtype=flat.dtype)
    tile = 0
    for i in range(pr // 128):
        for j in range(pc // 4):
            block = flat[tile * 512 : (tile + 1) * 512]
            for r in range(128):
                a, b = divmod(r, 32)
                for c in range(4):
                    out[i * 128 + r, j * 4 + c] = block[16 * b + 4 * a + c]
            tile += 1
    return out[:rows, :cols]


def _unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    codes = packed.view(torch.uint8)
    pair = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(*codes.shape[:-1], -1)
    return f4_unpacked_to_f32(pair)


def fake_scaled_mm(a: torch.Tensor, b: torch.Tensor, **kw: Any) -> torch.Tensor:
    """What torch's CUDA ``F.scaled_mm`` checks and computes for the three block layouts."""
    sa, sb, kind_a, kind_b = (
        kw["scale_a"],
        kw["scale_b"],
        kw["scale_recipe_a"],
        kw["scale_recipe_b"],
    )
    assert a.stride(1) == 1 and b.stride(0) == 1  # row-major a, column-major b
    k_mult = 2 if a.dtype == torch.float4_e2m1fn_x2 else 1
    m, k, n = a.shape[0], a.shape[1] * k_mult, b.shape[1]
    st = F.ScalingType
    if kind_a == st.BlockWise1x32:
        assert sa.dtype == torch.float8_e8m0fnu and sa.is_contiguous()
        exp = lambda s, r: torch.exp2(_unblocked(s.view(torch.uint8), r, k // 32).float() - 127)  # noqa: E731
        av = a.float() * exp(sa, m).repeat_interleave(32, 1)
        bv = b.t().float() * exp(sb, n).repeat_interleave(32, 1)
        return (av @ bv.t()).to(kw["output_dtype"])
    if kind_a == [st.BlockWise1x16, st.TensorWise]:
        e4 = lambda s, r: _unblocked(s.view(torch.uint8), r, k // 16).view(E4M3).float()  # noqa: E731
        av = _unpack_fp4(a) * e4(sa[0], m).repeat_interleave(16, 1)
        bv = _unpack_fp4(b.t()) * e4(sb[0], n).repeat_interleave(16, 1)
        return ((av @ bv.t()) * (sa[1] * sb[1])).to(kw["output_dtype"])
    assert kind_a == st.BlockWise1x128 and sa.shape == (m, k // 128) and sa.stride(0) == 1
    av = a.float() * sa.repeat_interleave(128, 1)
    if kind_b == st.BlockWise128x128:
        kp = -(-k // 128 // 4) * 4
        assert sb.shape == (kp, n // 128) and sb.stride() == (1, kp)
        sbv = sb[: k // 128].repeat_interleave(128, 0).repeat_interleave(128, 1)
        bv = b.float() * sbv
    else:
        assert kind_b == st.BlockWise1x128 and sb.shape == (n, k // 128) and sb.stride(0) == 1
        bv = b.float() * sb.t().repeat_interleave(128, 0)
    return (av @ bv).to(kw["output_dtype"])


def test_swizzle_is_torchaos_to_blocked() -> None:
    s = torch.randint(0, 255, (200, 9), dtype=torch.uint8)
    assert torch.equal(kernels.to_blocked(s), to_blocked(s).flatten())
    assert torch.equal(_unblocked(kernels.to_blocked(s), 200, 9), s)


@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_the_block_kernels_layouts_on_the_cpu(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(256, 128, bias=False)
    x, g = torch.randn(128, 256), torch.randn(128, 128) * 1e-2
    monkeypatch.setattr(kernels.F, "scaled_mm", fake_scaled_mm)
    results = []
    for hardware in (False, True):
        torch.manual_seed(0)
        plan = Plan(get_recipe(recipe), torch.bfloat16, scaled_mm=hardware)
        results.append(
            run(lambda t, p=plan: fp8_linear(t, lin.weight, None, p), x, g, [lin.weight])
        )
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-5)  # bf16 outputs
