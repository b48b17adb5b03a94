"""What the speed model needs to know of a candidate: the format of each GEMM operand.

A 16-bit candidate runs all six (GEMM, operand) pairs in its dtype, a kept module in float32
(or, around fp8, in the region's dtype). An fp8 recipe of the registry
(``mixprec._src.fp8.recipes``) is read cast by cast: its format (e4m3, e5m2: 8 bits) and its
granularity (per tensor, per row); a matmul whose casts are ``None`` runs in the region's dtype.
Block-scaled recipes are described from their published definitions (element bits, block,
scale dtype) under their rule words until the registry carries those fields:

* ``mxfp8``: the OCP MX format as TransformerEngine's ``MXFP8BlockScaling`` runs it: e4m3 in
  32-element blocks with one E8M0 (1-byte) scale each, on every operand.
* ``blockwise`` (``"fp8:blockwise"``): DeepSeek-V3's scaling (TE ``Float8BlockScaling``):
  e4m3, fp32 scales per 1 x 128 tile of activations and gradients, per 128 x 128 block of
  weights.
* ``nvfp4``: the NVFP4 training recipe (arXiv 2509.25149, TE ``NVFP4BlockScaling``): e2m1 (4
  bits) in 16-element blocks with E4M3 scales, one fp32 scale per tensor on top, 16 x 16 blocks
  for weights.
"""

from __future__ import annotations

import torch

from mixprec._src.advisor.speed import BF16, FP32, ROW, Format, Operands
from mixprec._src.fp8.recipes import RECIPES, Cast, Recipe

_MX = Format("fp8", 8, 32, 1)
_BLOCK_1D = Format("fp8", 8, 128, 4)
_BLOCK_2D = Format("fp8", 8, 128, 4, tile=128)
_FP4 = Format("fp4", 4, 16, 1, tensor_scale=True)
_FP4_2D = Format("fp4", 4, 16, 1, tile=16, tensor_scale=True)

#: Block-scaled recipes by word, in the registry's order (x, w, dy_gi, w_gi, dy_gw, x_gw).
BLOCK_RECIPES: dict[str, Operands] = {
    "mxfp8": Operands.uniform(_MX),
    "blockwise": Operands(_BLOCK_1D, _BLOCK_2D, _BLOCK_1D, _BLOCK_2D, _BLOCK_1D, _BLOCK_1D),
    "nvfp4": Operands(_FP4, _FP4_2D, _FP4, _FP4_2D, _FP4, _FP4),
}


def dtype_format(dtype: torch.dtype) -> Format:
    """The format of a module that runs in ``dtype`` (16-bit, or float32)."""
    return FP32 if dtype == torch.float32 else BF16


def _cast_format(cast: Cast | None, high: Format) -> Format:
    if cast is None:
        return high
    bits = torch.finfo(cast.dtype).bits
    kind = "fp8" if bits == 8 else "fp4"
    return Format(kind, bits, ROW if cast.rowwise else None, 4)


def recipe_operands(name: str, high: Format = BF16) -> Operands | None:
    """The operand formats of fp8 recipe ``name`` (registry or block-scaled word), None if
    the speed model does not know it; ``high`` for the matmuls a recipe leaves unquantized."""
    if name in BLOCK_RECIPES:  # described above (the registry has them too now, #24)
        return BLOCK_RECIPES[name]
    recipe: Recipe | None = RECIPES.get(name)
    if recipe is None:
        return None
    casts = (recipe.x, recipe.w, recipe.dy_gi, recipe.w_gi, recipe.dy_gw, recipe.x_gw)
    return Operands(*(_cast_format(c, high) for c in casts))
