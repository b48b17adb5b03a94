"""Block-scaled casts and back, and the per-cast statistics: one mechanism for every recipe.

An operand of a matmul is a 2D tensor with a contraction dimension ``dim``. Its cast's block
(``(across, along)`` that dimension, 0 = all of it) tiles it; the tensor is viewed as
``(R/br, br, C/bc, bc)`` so that one absolute maximum per block falls out of one reduction, the
scale mode of :mod:`.formats` turns those maxima into scales and codes, and dequantizing
multiplies (or divides) each block by its scale. A tensorwise cast is the block of the whole
tensor, a rowwise one the block of a whole row. The fp32 values dequantized here are the values
the hardware's block-scaled matmul multiplies, so an fp32 matmul of them is the emulation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mixprec._src.devices import caps
from mixprec._src.fp8.formats import cast_blocks, clamped, factor, fmt_max, hadamard, widen
from mixprec._src.fp8.recipes import Cast

_DIVIDES = ("amax", "pow2")  # torchao.float8 dequantizes by dividing by its scale


class Quantized(NamedTuple):
    """One cast operand: codes in the operand's layout, one scale per block.

    Attributes:
        codes: the element values in the element format (e2m1 values held in an e4m3 tensor).
        scale: per block, shape ``(R/br, 1, C/bc, 1)``, in the scale mode's storage.
        tensor_scale: NVFP4's fp32 tensor scale (else None).
        amax: per block absolute maxima (same shape as ``scale``).
        block: ``(br, bc)``, the block's extent along the rows and the columns.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor | None
    amax: torch.Tensor
    block: tuple[int, int]


def block_shape(shape: torch.Size | tuple[int, ...], cast: Cast, dim: int) -> tuple[int, int]:
    """The extent ``(rows, cols)`` of one block of ``cast`` on a 2D operand contracting along
    ``dim``.

    Example:
        >>> block_shape((64, 96), Cast(torch.float8_e4m3fn, block=(1, 32)), 0)
        (32, 1)

    Host sync: none.
    """
    across, along = cast.block
    br, bc = (across, along) if dim == 1 else (along, across)
    return br or shape[0], bc or shape[1]


def quantize(
    x: torch.Tensor, cast: Cast, dim: int, gen: torch.Generator | None = None
) -> tuple[Quantized, torch.Tensor]:
    """Cast the 2D ``x`` (contracting along ``dim``; its extents multiples of the block's) per
    ``cast``: ``(quantized, source)``, the source being ``x`` or its Hadamard transform, the
    tensor whose values were cast. ``gen`` supplies stochastic rounding's draws.

    Example:
        >>> q, _ = quantize(torch.tensor([[1.0, -2.0]]), Cast(torch.float8_e4m3fn), 1)
        >>> dequantize(q, Cast(torch.float8_e4m3fn))
        tensor([[ 1., -2.]])

    Host sync: none.
    """
    src = hadamard(x, dim) if cast.hadamard else x
    rows, cols = src.shape
    br, bc = block_shape(src.shape, cast, dim)
    x4 = src.reshape(rows // br, br, cols // bc, bc)
    a = x4.abs().amax(dim=(1, 3), keepdim=True)
    codes, scale, tensor_scale = cast_blocks(x4.to(torch.float32), a, cast, gen)
    return Quantized(codes.reshape(rows, cols), scale, tensor_scale, a, (br, bc)), src


def dequantize(q: Quantized, cast: Cast) -> torch.Tensor:
    """The fp32 values of a cast operand, in its layout.

    Example:
        >>> cast = Cast(torch.float8_e4m3fn, block=(1, 2), scale="e8m0")
        >>> q, _ = quantize(torch.tensor([[3.0, 1.0, 0.5, 8.0]]), cast, 1)
        >>> dequantize(q, cast)
        tensor([[3.0000, 1.0000, 0.5000, 8.0000]])

    Host sync: none.
    """
    rows, cols = q.codes.shape
    br, bc = q.block
    c4 = widen(q.codes).reshape(rows // br, br, cols // bc, bc)
    if cast.scale in _DIVIDES:
        c4 = c4.div_(q.scale)
    else:
        c4 = c4.mul_(factor(q.scale, q.tensor_scale, cast))
    return c4.reshape(rows, cols)


def multiplier(q: Quantized, cast: Cast) -> torch.Tensor:
    """Per block, what the values were multiplied by before the cast (the inverse of the
    dequantization factor): one convention for every mode, for statistics.

    Host sync: none.
    """
    if cast.scale in _DIVIDES:
        return q.scale
    return 1.0 / factor(q.scale, q.tensor_scale, cast)


def cast_stats(
    src: torch.Tensor,
    q: Quantized,
    cast: Cast,
    count_nonfinite: bool,
    elements: int,
    source: torch.Tensor | None = None,
) -> torch.Tensor:
    """One row of :data:`~.stats.STAT_COLUMNS` for one cast, on the device in its widest float.

    ``saturated`` counts elements cast to the format's largest magnitude, ``flushed`` the
    non-zero elements of blocks with a finite amax that became zero (a non-finite block is
    counted as non-finite, not flushed), ``nonfinite`` the inf/NaN elements of the source (only
    when ``count_nonfinite``: an operand cast twice is counted once), ``elements`` the real
    elements (padding excluded), ``blocks`` the scales; ``block_saturated`` and
    ``block_underflow`` the blocks whose scale hit the top or the bottom of its format.
    ``scale`` is the smallest multiplier, ``scale_max`` the largest among blocks holding
    non-zero finite values. The counts cover the user's tensor: the first ``elements`` of the
    rows (rows padded to the blocks are not counted) and, for ``nonfinite``, ``source``, the
    tensor before a Hadamard transform (which spreads one inf over its block).

    Example:
        >>> x = torch.tensor([[1e-9, 1.0, 0.0]])
        >>> q, src = quantize(x, Cast(torch.float8_e4m3fn), 1)
        >>> cast_stats(src, q, Cast(torch.float8_e4m3fn), True, 3).tolist()
        [1.0, 448.0, 448.0, 1.0, 1.0, 0.0, 3.0, 1.0, 0.0, 0.0]

    Host sync: none.
    """
    wide = caps(src.device).wide_float
    rows, cols = src.shape
    br, bc = q.block
    x4 = src.reshape(rows // br, br, cols // bc, bc)
    mag = widen(q.codes).reshape(x4.shape).abs()
    real = elements // cols  # the user's rows; the rest pads them to the blocks
    saturated = (mag == fmt_max(cast.dtype)).reshape(rows, cols)[:real].sum()
    flushed = ((mag == 0) & (x4 != 0) & torch.isfinite(q.amax)).reshape(rows, cols)[:real].sum()
    user = (src if source is None else source)[:real]
    nonfinite = (~torch.isfinite(user)).sum() if count_nonfinite else torch.zeros_like(saturated)
    high, low = clamped(q.amax, cast)
    mult = multiplier(q, cast)
    live = (q.amax > 0) & torch.isfinite(q.amax)
    head = torch.stack([q.amax.amax(), mult.amin(), torch.where(live, mult, 0).amax()])
    counts = torch.stack([saturated, flushed, nonfinite]).to(wide)
    sizes = torch.tensor([float(elements), float(q.amax.numel())], dtype=wide, device=src.device)
    return torch.cat([head.to(wide), counts, sizes, torch.stack([high, low]).to(wide)])
