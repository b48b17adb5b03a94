"""The scale modes of :data:`~.recipes.SCALES`, element rounding and the Hadamard transform.

Each mode takes a tensor viewed as blocks, ``x4`` of shape ``(R/br, br, C/bc, bc)`` in fp32, and
its block absolute maxima ``a`` (shape ``(R/br, 1, C/bc, 1)``), and returns the element codes
(in the element format; fp4's e2m1 values are held exactly in an e4m3 tensor, one per byte),
the scale in the mode's own storage, and for NVFP4 the fp32 tensor scale. The arithmetic of each
mode is its reference's, operation for operation, so the emulated values are bit for bit the
reference's: torchao.float8 (``amax``, ``pow2``), DeepSeek-V3's description (``amax_div``),
torchao's MX RCEIL cast, which is cuBLAS's and TransformerEngine's (``e8m0``), and torchao's
``NVFP4Tensor`` with a tensor scale (``e4m3_fp32``).

A non-finite value is never hidden: an inf or NaN makes its block's amax non-finite and every
value of that block (of the whole tensor for a tensor-level scale) NaN or inf once dequantized.
"""

from __future__ import annotations

import functools

import torch

from mixprec._src.devices import caps
from mixprec._src.fp8.recipes import E2M1, E4M3, Cast

EPS = 1e-12  # amax floor: an all-zero block gets a large finite scale, not inf
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_TINY = float(torch.finfo(E4M3).tiny)  # 2**-6: NVFP4 block scales are clamped to it
E8M0_BIAS = 127

# The 16 signs of the random Hadamard transform, drawn once at random and fixed: the NVFP4 paper
# uses one sign vector for every layer and the whole of training.
_SIGNS = (1, -1, 1, 1, -1, 1, -1, -1, 1, 1, -1, 1, -1, -1, -1, 1)

Modes = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def fmt_max(dtype: torch.dtype) -> float:
    """The largest finite value of an element format (448 e4m3, 57344 e5m2, 6 e2m1).

    Example:
        >>> fmt_max(torch.float8_e4m3fn), fmt_max(E2M1)
        (448.0, 6.0)

    Host sync: none.
    """
    return E2M1_MAX if dtype == E2M1 else float(torch.finfo(dtype).max)


def scale_from_amax(a: torch.Tensor, cast: Cast) -> torch.Tensor:
    """torchao.float8's scale: fp32 ``fmt_max / max(amax, EPS)``, divided in the device's widest
    float, rounded down to a power of two for the ``pow2`` mode.

    Example:
        >>> scale_from_amax(torch.tensor(2.0), Cast(torch.float8_e4m3fn))
        tensor(224.)

    Host sync: none.
    """
    wide = caps(a.device).wide_float
    res = (fmt_max(cast.dtype) / a.to(wide).clamp(min=EPS)).to(torch.float32)
    if cast.scale == "pow2":
        res = torch.exp2(torch.floor(torch.log2(res)))
    return res


def widen(codes: torch.Tensor) -> torch.Tensor:
    """The fp32 values of fp8 codes (e4m3 or e5m2; fp4 values are held in e4m3), bit for bit
    ``codes.to(torch.float32)`` (NaN included), through fp16 bit operations: torch's CPU
    conversion from e4m3 is a scalar loop, these are vectorized. An e5m2 code is the top byte of
    the fp16 of the same value; an e4m3 one's exponent and mantissa bits are fp16's shifted by 7,
    which is the value divided by 2**8 (the exponent biases differ by 8; e4m3 subnormals land
    on fp16 subnormals), with the NaN codes (``S.1111.111``) given fp16's all-ones exponent.

    Example:
        >>> codes = torch.tensor([0.0, -1.5, 448.0, 2.0**-9]).to(torch.float8_e4m3fn)
        >>> widen(codes).tolist()
        [0.0, -1.5, 448.0, 0.001953125]

    Host sync: none.
    """
    if torch.compiler.is_compiling():  # inductor's own conversion is vectorized
        return codes.to(torch.float32)
    bits = codes.view(torch.uint8).to(torch.int16)
    if codes.dtype == torch.float8_e5m2:
        return bits.bitwise_left_shift_(8).view(torch.float16).to(torch.float32)
    assert codes.dtype == E4M3, codes.dtype
    # In place on two buffers (each intermediate tensor is one more allocation and pass).
    mag = bits & 0x7F
    bits.bitwise_and_(0x80).bitwise_left_shift_(8)  # the sign, fp16's bit 15
    bits.bitwise_or_(mag.bitwise_left_shift_(7))  # exponent and mantissa
    bits.bitwise_or_(mag.add_(0x80).bitwise_and_(0x4000))  # NaN (0x3F80): exponent all ones
    return bits.view(torch.float16).to(torch.float32).mul_(256.0)


def e8m0_exponent(a: torch.Tensor, cast: Cast) -> torch.Tensor:
    """The biased E8M0 exponent (uint8) of each block: ``ceil(log2(amax / fmt_max))`` + 127,
    clamped to the format (RCEIL); 255 for a NaN amax, 254 for an inf one.

    Example:
        >>> e8m0_exponent(torch.tensor([448.0, 449.0, 0.0]), Cast(E4M3, scale="e8m0")).tolist()
        [127, 128, 0]

    Host sync: none.
    """
    descale = a.to(torch.float32) / fmt_max(cast.dtype)
    finite = torch.clamp(torch.ceil(torch.log2(descale)), -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    return torch.where(
        torch.isnan(descale), 255, torch.where(torch.isinf(descale), 254, finite.to(torch.uint8))
    ).to(torch.uint8)


def e8m0_value(e: torch.Tensor) -> torch.Tensor:
    """fp32 value of E8M0 exponents: ``2**(e - 127)``, NaN for 255.

    Example:
        >>> e8m0_value(torch.tensor([127, 130, 255], dtype=torch.uint8)).tolist()
        [1.0, 8.0, nan]

    Host sync: none.
    """
    value = torch.exp2(e.to(torch.float32) - E8M0_BIAS)
    return torch.where(e == 255, torch.full_like(value, float("nan")), value)


def block_scales(a: torch.Tensor, cast: Cast) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scale of each block from its absolute maximum ``a``, in the mode's storage, and
    NVFP4's fp32 tensor scale (from the largest of ``a``: pass every block of the tensor).

    Example:
        >>> block_scales(torch.tensor([2.0, 448.0]), Cast(E4M3, scale="amax_div"))[0].tolist()
        [0.004464285913854837, 1.0]

    Host sync: none.
    """
    if cast.scale in ("amax", "pow2"):
        return scale_from_amax(a, cast), None
    if cast.scale == "amax_div":
        return a.to(torch.float32).clamp(min=EPS) / fmt_max(cast.dtype), None
    if cast.scale == "e8m0":
        return e8m0_exponent(a, cast), None
    tensor_scale = a.amax().to(torch.float32).clamp(min=EPS) / (E4M3_MAX * E2M1_MAX)
    block = (a.to(torch.float32) / E2M1_MAX) / tensor_scale
    return torch.clamp(block, min=E4M3_TINY, max=E4M3_MAX).to(E4M3), tensor_scale


def encode(
    x4: torch.Tensor,
    scale: torch.Tensor,
    tensor_scale: torch.Tensor | None,
    cast: Cast,
    gen: torch.Generator | None = None,
) -> torch.Tensor:
    """The element codes of the fp32 ``x4`` under block scales that broadcast against it (from
    :func:`block_scales`): elementwise, so a shard of rows is cast as the whole tensor's rows.

    Example:
        >>> cast = Cast(E4M3, scale="e8m0")
        >>> x = torch.tensor([[3.0, -0.5]])
        >>> encode(x, *block_scales(x.abs().amax(), cast), cast).float().tolist()
        [[384.0, -64.0]]

    Host sync: none.
    """
    if cast.scale in ("amax", "pow2"):
        return (x4 * scale).to(cast.dtype)
    if cast.scale == "amax_div":
        return (x4 / scale).to(cast.dtype)
    if cast.scale == "e8m0":
        # The multiplier cuBLAS and TransformerEngine apply: 1 for exponent 0 (2**127 is not
        # taken), 2**-127 for an inf amax, NaN for a NaN one.
        e = scale
        normal = torch.where(e == 0, 1.0, torch.exp2(E8M0_BIAS - e.to(torch.float32)))
        nan = torch.full_like(normal, float("nan"))
        rcp = torch.where(e == 255, nan, torch.where(e == 254, 2.0**-127, normal))
        m = fmt_max(cast.dtype)
        return (x4 * rcp).clamp_(-m, m).to(cast.dtype)
    assert tensor_scale is not None
    rcp = (1.0 / tensor_scale) / scale.to(torch.float32)
    v = (x4 * rcp).clamp_(-E2M1_MAX, E2M1_MAX)
    return round_e2m1(v, stochastic=cast.stochastic, gen=gen).to(E4M3)


def cast_blocks(
    x4: torch.Tensor, a: torch.Tensor, cast: Cast, gen: torch.Generator | None
) -> Modes:
    """Codes, scales and tensor scale of the fp32 blocks ``x4`` with block maxima ``a``.
    Host sync: none."""
    scale, tensor_scale = block_scales(a, cast)
    return encode(x4, scale, tensor_scale, cast, gen), scale, tensor_scale


def round_e2m1(
    v: torch.Tensor, *, stochastic: bool = False, gen: torch.Generator | None = None
) -> torch.Tensor:
    """Round values in ``[-6, 6]`` to e2m1 (0, 0.5, 1, 1.5, 2, 3, 4, 6): to nearest, ties to
    the even code, or stochastically (``P(up)`` = the distance from the value below over the
    step), drawing from ``gen`` or, by default, torch's generator of the device (as dropout
    does: ``torch.manual_seed`` makes the draws reproducible).

    Example:
        >>> round_e2m1(torch.tensor([0.25, 0.75, 2.5, 5.0, -5.1])).tolist()
        [0.0, 1.0, 2.0, 4.0, -6.0]

    Host sync: none.
    """
    mag = v.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    units = mag / step  # exact: the steps are powers of two
    if not stochastic:
        units = torch.round(units)  # half to even: the even units are the even codes
    else:
        low = torch.floor(units)
        draw = torch.rand(units.shape, generator=gen, device=units.device)
        units = low + (draw < units - low).to(units.dtype)
    return torch.copysign(units * step, v)


def factor(scale: torch.Tensor, tensor_scale: torch.Tensor | None, cast: Cast) -> torch.Tensor:
    """The fp32 multiplier that dequantizes each block's codes (modes other than ``amax`` and
    ``pow2``, which divide by their scale as torchao.float8 does).

    Host sync: none.
    """
    if cast.scale == "e8m0":
        return e8m0_value(scale)
    if cast.scale == "e4m3_fp32":
        assert tensor_scale is not None
        return tensor_scale * scale.to(torch.float32)
    return scale


def clamped(a: torch.Tensor, cast: Cast) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of blocks whose scale hit its format's top (the block's values saturate) and of
    blocks holding non-zero values whose scale hit its bottom (their values underflow).

    Example:
        >>> a = torch.tensor([0.0, 1e-40, 1.0])
        >>> [int(c) for c in clamped(a, Cast(E4M3, block=(1, 32), scale="e8m0"))]
        [0, 1]

    Host sync: none.
    """
    nonzero = a > 0
    if cast.scale == "e8m0":
        log = torch.ceil(torch.log2(a.to(torch.float32) / fmt_max(cast.dtype)))
        high, low = (log > E8M0_BIAS) & torch.isfinite(a), (log < -E8M0_BIAS) & nonzero
    elif cast.scale == "e4m3_fp32":
        tensor_scale = a.amax().to(torch.float32).clamp(min=EPS) / (E4M3_MAX * E2M1_MAX)
        block = (a.to(torch.float32) / E2M1_MAX) / tensor_scale
        # The block holding the amax computes to E4M3_MAX up to float32 rounding: only a block
        # beyond that rounding hit the top.
        high, low = block > E4M3_MAX * (1 + 2**-16), (block < E4M3_TINY) & nonzero
    else:
        high, low = torch.zeros_like(nonzero), (a < EPS) & nonzero
    return high.sum(), low.sum()


@functools.lru_cache(maxsize=8)
def _rht(device: torch.device) -> torch.Tensor:
    """The 16x16 random Hadamard transform ``H diag(signs) / 4`` (orthogonal) in fp32."""
    h = torch.ones(1, 1)
    while h.shape[0] < 16:  # Sylvester's construction
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.tensor(_SIGNS, dtype=torch.float32)
    return (h * signs / 4).to(device)


def hadamard(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` in fp32 with the 16x16 random Hadamard transform applied along ``dim`` in groups
    of 16 (its length a multiple of 16). The transform is orthogonal: applied to both operands of
    a matmul along their contraction dimension, it leaves the exact product unchanged and spreads
    outliers over 16 elements before the cast.

    Example:
        >>> a, b = torch.randn(32, 3), torch.randn(32, 5)
        >>> torch.allclose(hadamard(a, 0).t() @ hadamard(b, 0), a.t() @ b, atol=1e-5)
        True

    Host sync: none.
    """
    r = _rht(x.device)
    x = x.to(torch.float32)
    if dim == 0:
        return (r @ x.reshape(-1, 16, x.shape[1])).reshape(x.shape)
    return (x.reshape(x.shape[0], -1, 16) @ r.t()).reshape(x.shape)
