"""Dynamic scaled casts to fp8 and back, and the per-cast statistics.

The scale of a tensor (or of each slice along a dimension) is ``fp8_max / amax`` from its current
absolute maximum, computed in the device's widest float and stored as fp32, optionally rounded
down to a power of two: the same arithmetic as torchao.float8, so emulated results match it bit
for bit. ``x * scale`` then fits the format, so the plain (saturating) cast never clips a finite
value. A non-finite value is never hidden: an inf or NaN makes its amax non-finite, its scale 0 or
NaN, and every value cast with that scale NaN once dequantized (the whole tensor for a tensorwise
scale, its slice for a rowwise one), so GradScaler and ``find_nonfinite`` see it.
"""

from __future__ import annotations

import torch

from mixprec._src.devices import caps
from mixprec._src.fp8.recipes import Cast

EPS = 1e-12  # amax floor: an all-zero tensor gets a large finite scale, not inf
STAT_COLUMNS = ("amax", "scale", "saturated", "flushed", "nonfinite", "elements")


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 format (448 for e4m3, 57344 for e5m2).

    Example:
        >>> fp8_max(torch.float8_e4m3fn)
        448.0

    Host sync: none.
    """
    return float(torch.finfo(dtype).max)


def amax(x: torch.Tensor, cast: Cast, dim: int) -> torch.Tensor:
    """Absolute maximum: of the whole tensor, or of each slice along ``dim`` (kept as size 1).

    Example:
        >>> amax(torch.tensor([[1.0, -3.0], [2.0, 0.5]]), Cast(torch.float8_e4m3fn, True), 1)
        tensor([[3.],
                [2.]])

    Host sync: none.
    """
    if cast.rowwise:
        return x.abs().amax(dim=dim, keepdim=True)
    return x.abs().amax()


def scale_from_amax(a: torch.Tensor, cast: Cast) -> torch.Tensor:
    """The fp32 scale ``fp8_max / max(amax, EPS)``, divided in the device's widest float.

    Example:
        >>> scale_from_amax(torch.tensor(2.0), Cast(torch.float8_e4m3fn))
        tensor(224.)

    Host sync: none.
    """
    wide = caps(a.device).wide_float
    res = (fp8_max(cast.dtype) / a.to(wide).clamp(min=EPS)).to(torch.float32)
    if cast.pow2:
        res = torch.exp2(torch.floor(torch.log2(res)))
    return res


def quantize(
    x: torch.Tensor, cast: Cast, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast ``x`` to fp8 with a dynamic scale along ``dim``: ``(bits, scale, amax)``.

    ``x ≈ bits.float() / scale``; for a rowwise cast ``scale`` has size 1 along ``dim``.

    Example:
        >>> bits, scale, _ = quantize(torch.tensor([1.0, -2.0]), Cast(torch.float8_e4m3fn), 0)
        >>> dequantize(bits, scale)
        tensor([ 1., -2.])

    Host sync: none.
    """
    a = amax(x, cast, dim)
    scale = scale_from_amax(a, cast)
    wide = x.to(torch.float32)
    bits = (wide * scale if wide is x else wide.mul_(scale)).to(cast.dtype)
    return bits, scale, a


def dequantize(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of fp8 ``bits`` cast with ``scale`` (division, as torchao emulates).

    Example:
        >>> bits, scale, _ = quantize(torch.tensor([3.0]), Cast(torch.float8_e5m2), 0)
        >>> dequantize(bits, scale)
        tensor([3.])

    Host sync: none.
    """
    return bits.to(torch.float32).div_(scale)


def cast_stats(
    x: torch.Tensor,
    bits: torch.Tensor,
    scale: torch.Tensor,
    a: torch.Tensor,
    cast: Cast,
    count_nonfinite: bool,
) -> torch.Tensor:
    """One row of :data:`STAT_COLUMNS` for one cast, on ``x``'s device in its widest float.

    ``saturated`` counts elements whose fp8 magnitude is the format's maximum, ``flushed`` the
    non-zero elements that became zero, ``nonfinite`` the inf/NaN elements of ``x`` (only when
    ``count_nonfinite``: an operand cast twice is counted once).

    Example:
        >>> x = torch.tensor([1e-9, 1.0, 0.0])
        >>> bits, scale, a = quantize(x, Cast(torch.float8_e4m3fn), 0)
        >>> cast_stats(x, bits, scale, a, Cast(torch.float8_e4m3fn), True).tolist()
        [1.0, 448.0, 1.0, 1.0, 0.0, 3.0]

    Host sync: none.
    """
    wide = caps(x.device).wide_float
    mag = bits.to(torch.float32).abs()
    saturated = (mag == fp8_max(cast.dtype)).sum()
    flushed = ((mag == 0) & (x != 0)).sum()
    nonfinite = (~torch.isfinite(x)).sum() if count_nonfinite else torch.zeros_like(saturated)
    counts = torch.stack([saturated, flushed, nonfinite]).to(wide)
    head = torch.stack([a.amax().to(wide), scale.amin().to(wide)])
    numel = torch.full((1,), float(x.numel()), dtype=wide, device=x.device)
    return torch.cat([head, counts, numel])
