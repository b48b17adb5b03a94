"""The cost order of precisions: which option is cheaper, whatever order the user listed them in.

Without a GPU the cost of a precision is its bits per element in memory, averaged over the six
(matmul, operand) pairs of a module: 16 for fp16 and bf16; for a recipe, its element bits (8 for
e4m3/e5m2, 4 for e2m1) plus the bits of its scales spread over the elements they scale (MXFP8's
E8M0 scale per 32 elements: 8.25; NVFP4's E4M3 scale per 16, a 16 x 16 tile for weights: 4.34;
an fp32 scale per row, counted over a row of :data:`ROW_LENGTH`: 8.008; one per tensor: 8), a
matmul the recipe leaves in 16-bit (``rowwise_gw_hp``'s weight gradient, a rule per matmul's
``bf16`` part) counting 16. With a GPU the cost is the speed model's predicted time of the
module in that option, the bits breaking ties. A module's options of equal cost come the most
precise first (its measured error); candidates of equal bits are ordered fp16 before bf16 (fp16
the more precise: bf16 is the fallback where fp16 overflows), then by word.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mixprec._src.advisor.arguments import Candidate
from mixprec._src.fp8.recipes import Cast, get_recipe

#: Scales stored in one byte (E8M0; E4M3 under an fp32 tensor scale); the others are fp32.
_ONE_BYTE_SCALES = ("e8m0", "e4m3_fp32")
#: The contraction a per-row scale is counted over (a typical hidden size): rowwise costs a
#: little more than tensorwise, as it does on a GPU.
ROW_LENGTH = 4096
#: Among 16-bit dtypes of equal bits: fp16 first (the more precise), then bf16.
_DTYPE_TIE = {torch.float16: 0, torch.bfloat16: 1}

Key = tuple[float, float, int, str]


def _cast_bits(cast: Cast | None, high: torch.dtype | None) -> float:
    if cast is None:
        return 32.0 if high == torch.float32 else 16.0
    bits = 4.0 if "float4" in str(cast.dtype) else 8.0
    across, along = cast.block
    if along == 0:  # one scale per tensor (none worth counting) or per row of the contraction
        return bits + (32 / ROW_LENGTH if across else 0.0)
    scale = 8 if cast.scale in _ONE_BYTE_SCALES else 32
    return bits + scale / (along * max(across, 1))


def bits(word: str) -> float:
    """A precision's bits per element, averaged over a module's six operands.

    Example:
        >>> [round(bits(w), 3) for w in ("nvfp4", "fp8", "fp8:rowwise", "mxfp8", "bf16")]
        [4.344, 8.0, 8.008, 8.25, 16.0]

    Host sync: none.
    """
    cand = Candidate.of(word) if word != "fp32" else None
    if cand is None:
        return 32.0
    if cand.recipe is None:
        return 16.0
    recipe = get_recipe(cand.recipe)
    return sum(_cast_bits(c, recipe.high[i // 2]) for i, c in enumerate(recipe.casts)) / 6


def cost_key(word: str, time: float = 0.0) -> Key:
    """The sort key of an option: predicted seconds (0 without a GPU), bits, the 16-bit tie,
    the word.

    Host sync: none.
    """
    cand = Candidate.of(word) if word != "fp32" else None
    tie = 2 if cand is None or cand.dtype is None else _DTYPE_TIE.get(cand.dtype, 2)
    return (time, bits(word), tie, word)


def cost_order(cands: Sequence[Candidate]) -> list[Candidate]:
    """The candidates cheapest first by bits (the order of the table's columns, the region's
    dtype and the search's options without a GPU).

    Host sync: none.
    """
    return sorted(cands, key=lambda c: cost_key(c.word))
