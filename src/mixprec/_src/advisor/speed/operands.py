"""What the speed model needs to know of a candidate: the format of each GEMM operand.

A 16-bit candidate runs all six (GEMM, operand) pairs in its dtype, a kept module in float32
(or, around fp8, in the region's dtype). A recipe of the fp8 registry
(``mixprec._src.fp8.recipes``) is read cast by cast: its element format (e4m3, e5m2: 8 bits;
e2m1: 4), its block (``(across, along)`` the contraction: per tensor, per row, 1 x 32 for MXFP8,
1 x 128 and 128 x 128 for DeepSeek's blockwise, 16-element blocks for NVFP4) and its scale's
storage (fp32; one byte for E8M0 and for NVFP4's E4M3 block scales, which sit under one fp32
tensor scale), and where it runs in hardware (the recipe's ``capability``); a matmul whose casts
are ``None`` runs in the region's dtype. Stochastic rounding and NVFP4's Hadamard transform add
no bytes (TransformerEngine fuses them into its casts).
"""

from __future__ import annotations

import torch

from mixprec._src.advisor.arguments import Candidate
from mixprec._src.advisor.speed.gpus import GPU
from mixprec._src.advisor.speed.model import BF16, FP32, ROW, Format, Operands, runs
from mixprec._src.fp8.recipes import Cast, get_recipe

#: Scales stored in one byte (E8M0; E4M3 under an fp32 tensor scale); the others are fp32.
_ONE_BYTE_SCALES = ("e8m0", "e4m3_fp32")


def dtype_format(dtype: torch.dtype) -> Format:
    """The format of a module that runs in ``dtype`` (16-bit, or float32)."""
    return FP32 if dtype == torch.float32 else BF16


def cast_format(cast: Cast | None, high: Format) -> Format:
    """A registry cast as the speed model's format (``high`` for None: high precision)."""
    if cast is None:
        return high
    bits = 4 if "float4" in str(cast.dtype) else 8
    kind = "fp8" if bits == 8 else "fp4"
    across, along = cast.block
    size = 1 if cast.scale in _ONE_BYTE_SCALES else 4
    if along == 0:  # per tensor (0, 0) or per row (1, 0)
        return Format(kind, bits, ROW if across else None, size)
    tensor_scale = cast.scale == "e4m3_fp32"
    return Format(kind, bits, along, size, tile=max(across, 1), tensor_scale=tensor_scale)


def recipe_operands(name: str, high: Format = BF16) -> Operands:
    """The operand formats of the recipe ``name`` (the registry's, or one put together per
    matmul); ``high`` for the matmuls it leaves in the region's dtype (a matmul it runs in a
    dtype of its own takes that dtype's format)."""
    recipe = get_recipe(name)
    highs = [high if d is None else dtype_format(d) for d in recipe.high]
    x, w, dy_gi, w_gi, dy_gw, x_gw = (
        cast_format(c, highs[i // 2]) for i, c in enumerate(recipe.casts)
    )
    return Operands(x, w, dy_gi, w_gi, dy_gw, x_gw, recipe.capability)


def operands(cand: Candidate | None, region: torch.dtype, kept_word: str = "fp32") -> Operands:
    """The operand formats of a candidate, or (``cand`` None) of the kept precision
    (``kept_word``: ``"fp32"`` or the region's dtype word)."""
    high = dtype_format(region)
    if cand is None:
        return Operands.uniform(dtype_format(torch.float32) if kept_word == "fp32" else high)
    if cand.recipe is not None:
        return recipe_operands(cand.recipe, high)
    assert cand.dtype is not None
    return Operands.uniform(dtype_format(cand.dtype))


def runs_on(gpu: GPU, cand: Candidate) -> bool:
    """Whether ``gpu`` runs ``cand``'s matmuls in hardware (16-bit: always). Host sync: none."""
    return cand.recipe is None or runs(gpu, operands(cand, torch.bfloat16))


def no_kernel(gpu: GPU, cands: list[Candidate]) -> str:
    """Why none of the recipe candidates ``cands`` is an option on ``gpu``."""
    words = [c.word for c in cands]
    lows = ", ".join(
        sorted({"{}.{}".format(*get_recipe(c.recipe).capability[0]) for c in cands if c.recipe})
    )
    cap = f"{gpu.capability[0]}.{gpu.capability[1]}"
    return (
        f"{gpu.name} has no kernel for {', '.join(words)} (compute capability {cap}; "
        f"{'they run' if len(words) > 1 else 'it runs'} in hardware from {lows})"
    )
