"""The hardware matmuls: ``torch._scaled_mm`` on cast operands, in the layouts torch's CUDA
kernels take. Only :func:`mixprec._src.fp8.matmul` calls them, where the device table and the
device's compute capability say the kernel exists (never on the CPU, where ``_scaled_mm`` is
oneDNN's reference kernel). ``benchmarks/gpu_check.py`` runs each against the emulation.

An operand is a :class:`Side`: a cast tensor, its cast, and whether the matmul takes its
transpose. Each kernel wants the first operand row-major and the second column-major (both
contraction-contiguous); scales are laid out as each scaling type requires (swizzled 128x4 tiles
for MX and NVFP4, outer-dimension-major fp32 for 1x128, K-major padded to 4 for 128x128).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from mixprec._src import torch_compat
from mixprec._src.fp8.casts import Quantized
from mixprec._src.fp8.recipes import Cast

_E2M1_CODES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
Scales = torch.Tensor | list[torch.Tensor]


@dataclass(frozen=True)
class KernelCall:
    """One hardware matmul call, as built: ``torch._scaled_mm`` (``recipe_a`` None) or
    ``F.scaled_mm`` with block scales. A dry run records and checks these instead of running
    them (:mod:`mixprec._src.dryrun`); :meth:`run` runs one.

    Attributes:
        a, b: the operands (``a`` row-major, ``b`` column-major for CUDA).
        scale_a, scale_b: the scales as passed (a list for NVFP4's two levels).
        recipe_a, recipe_b: ``F.ScalingType`` names per scale (empty: ``torch._scaled_mm``).
        swizzle_a, swizzle_b: ``F.SwizzleType`` names per scale (empty: none given).
        out_dtype: the output dtype. fast_accum: fast (non-IEEE) accumulation. bias: if any.
        blocks_a, blocks_b: the (rows, cols) block-scale matrix each swizzled scale lays out,
            for the content check; None where the scale is not swizzled.
    """

    a: torch.Tensor
    b: torch.Tensor
    scale_a: Scales
    scale_b: Scales
    out_dtype: torch.dtype
    recipe_a: tuple[str, ...] = ()
    recipe_b: tuple[str, ...] = ()
    swizzle_a: tuple[str, ...] = ()
    swizzle_b: tuple[str, ...] = ()
    fast_accum: bool = False
    bias: torch.Tensor | None = None
    blocks_a: tuple[int, int] | None = field(default=None)
    blocks_b: tuple[int, int] | None = field(default=None)

    def run(self) -> torch.Tensor:
        """The kernel's output. Host sync: none."""
        if not self.recipe_a:
            return torch_compat.scaled_mm(
                self.a,
                self.b,
                scale_a=_one(self.scale_a),
                scale_b=_one(self.scale_b),
                bias=self.bias,
                out_dtype=self.out_dtype,
                use_fast_accum=self.fast_accum,
            )
        return F.scaled_mm(
            self.a,
            self.b,
            scale_a=self.scale_a,
            scale_recipe_a=_enums(F.ScalingType, self.recipe_a),
            scale_b=self.scale_b,
            scale_recipe_b=_enums(F.ScalingType, self.recipe_b),
            swizzle_a=_enums(F.SwizzleType, self.swizzle_a) if self.swizzle_a else None,
            swizzle_b=_enums(F.SwizzleType, self.swizzle_b) if self.swizzle_b else None,
            bias=self.bias,
            output_dtype=self.out_dtype,
            use_fast_accum=self.fast_accum,
        )


def _one(scale: Scales) -> torch.Tensor:
    return scale[0] if isinstance(scale, list) else scale


def _enums(kind: Any, names: tuple[str, ...]) -> Any:
    found = [getattr(kind, n) for n in names]
    return found[0] if len(found) == 1 else found


@dataclass
class DryRunGpu:
    """A GPU a dry run routes as (its compute capability), the call site being run, and the
    kernel calls recorded there; the one state of a dry run (:func:`routed_as`)."""

    capability: tuple[int, int]
    site: tuple[str, str, str] = ("", "", "")  # module, matmul, recipe
    calls: list[Any] = field(default_factory=list)
    launch: Any = None  # (target, call) -> output: the dry run's checker

    def note(self, kind: str, detail: Any) -> None:
        """Record a matmul that takes no kernel: ``"emulated"`` or ``"high"`` (precision).
        Host sync: none."""
        self.calls.append((self.site, kind, detail))


_TARGET: ContextVar[DryRunGpu | None] = ContextVar("mixprec_dry_run_target", default=None)


def target() -> DryRunGpu | None:
    """The dry run in progress, if any (a dry run runs eagerly: never in compiled code, which
    does not trace a context variable). Host sync: none."""
    if torch.compiler.is_compiling():
        return None
    return _TARGET.get()


@contextlib.contextmanager
def routed_as(found: DryRunGpu) -> Iterator[DryRunGpu]:
    """Route meta tensors' matmuls as ``found``'s GPU would, recording each kernel call.
    Host sync: none."""
    token = _TARGET.set(found)
    try:
        yield found
    finally:
        _TARGET.reset(token)


def launch(call: KernelCall) -> torch.Tensor:
    """Run ``call``, or hand it to the dry run (or recorder) in progress. Host sync: none."""
    found = target()
    if found is not None and found.launch is not None:
        out: torch.Tensor = found.launch(found, call)
        return out
    return call.run()


class Side(NamedTuple):
    """One operand of a matmul: the matrix is ``q.codes`` (``.t()`` when ``t``)."""

    q: Quantized
    cast: Cast
    t: bool = False

    def flipped(self) -> Side:
        """The same operand, transposed. Host sync: none."""
        return Side(self.q, self.cast, not self.t)


def oriented(side: Side) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The operand's codes, its scales as a 2D matrix (one per block), and the block's extent
    along the rows, all in the operand's orientation.

    Example:
        >>> from mixprec._src.fp8.casts import quantize
        >>> cast = Cast(torch.float8_e4m3fn, block=(1, 2), scale="amax_div")
        >>> codes, scale, rows = oriented(Side(quantize(torch.ones(4, 6), cast, 1)[0], cast, True))
        >>> tuple(codes.shape), tuple(scale.shape), rows
        ((6, 4), (3, 4), 2)

    Host sync: none.
    """
    q = side.q
    rows, cols = q.codes.shape
    br, bc = q.block
    scale = q.scale.reshape(rows // br, cols // bc)
    if side.t:
        return q.codes.t(), scale.t(), bc
    return q.codes, scale, br


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """A (rows, cols) scale matrix in cuBLAS's swizzled block-scale layout: padded to 128 x 4
    tiles, each tile stored as 32 rows of 16 (rows ``i``, ``i + 32``, ``i + 64``, ``i + 96``
    side by side), flattened.

    Example:
        >>> to_blocked(torch.arange(8.0).reshape(2, 4)).shape
        torch.Size([512])

    Host sync: none.
    """
    rows, cols = scale.shape
    pr, pc = -rows % 128, -cols % 4
    if pr or pc:
        scale = F.pad(
            scale.view(torch.uint8) if scale.element_size() == 1 else scale, (0, pc, 0, pr)
        )
    r, c = scale.shape
    tiles = scale.reshape(r // 128, 128, c // 4, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1).contiguous()


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """e2m1 values (held in any float dtype), two per byte along the last dimension (the first
    in the low nibble), as ``torch.float4_e2m1fn_x2``.

    Example:
        >>> pack_e2m1(torch.tensor([[0.5, -6.0]])).view(torch.uint8).tolist()
        [[241]]

    Host sync: none.
    """
    v = values.to(torch.float32)
    mag = v.abs()
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for i, level in enumerate(_E2M1_CODES[1:], start=1):
        code = torch.where(mag == level, i, code).to(torch.uint8)
    code = code | (torch.signbit(v).to(torch.uint8) << 3)
    pairs = code.reshape(*code.shape[:-1], -1, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.contiguous().view(torch.float4_e2m1fn_x2)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_e2m1`: the e2m1 values, one per element, held in e4m3 (signed
    zeros kept).

    Example:
        >>> unpack_e2m1(pack_e2m1(torch.tensor([[0.5, -6.0]]))).float().tolist()
        [[0.5, -6.0]]

    Host sync: none.
    """
    b = packed.view(torch.uint8)
    nibbles = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], -1)
    levels = torch.tensor(_E2M1_CODES, dtype=torch.float32, device=b.device)
    table = torch.cat((levels, -levels)).to(torch.float8_e4m3fn)
    return table[nibbles.long()]


def _shape(scale: torch.Tensor) -> tuple[int, int]:
    return scale.shape[0], scale.shape[1]


def _per_row(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """2D block scales as 1D block scales: each block row repeated over the rows it covers."""
    return scale if rows == 1 else scale.repeat_interleave(rows, dim=0)


def tensor_row_mm(a: Side, b: Side, out: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """Tensorwise or rowwise ``_scaled_mm`` (scales applied after a tensorwise kernel for the
    rowwise matmuls without fast accumulation, as torchao does).

    Host sync: none.
    """
    qa, sa, _ = oriented(a)
    bt, sbt, _ = oriented(b.flipped())
    ia, ib = sa.reciprocal(), sbt.reciprocal()
    rowwise = not (a.cast.tensorwise and b.cast.tensorwise)
    if rowwise:  # the rowwise kernel wants both scales as vectors
        ia = ia.reshape(-1, 1).expand(qa.shape[0], 1).contiguous()
        ib = ib.reshape(1, -1).expand(1, bt.shape[0]).contiguous()
    else:
        ia, ib = ia.reshape(()), ib.reshape(())
    post = None
    if rowwise and not fast_accum:
        post, ia, ib = ia * ib, ia.new_ones(()), ia.new_ones(())
    kernel_out = torch.bfloat16 if rowwise else out  # rowwise kernels write bf16 only
    call = KernelCall(
        qa.contiguous(), bt.contiguous().t(), ia, ib, kernel_out, fast_accum=fast_accum
    )
    res = launch(call)
    return (res if post is None else res * post).to(out)


def block_mm(a: Side, b: Side, out: torch.dtype) -> torch.Tensor:
    """``F.scaled_mm`` with block scales: MXFP8 (1x32 E8M0), NVFP4 (1x16 E4M3 and a tensor
    scale; 16x16 weight blocks given as 1x16 rows), 1x128 / 128x128 fp32.

    Host sync: none.
    """
    if a.cast.scale == "e8m0":
        return _mx(a, b, out)
    if a.cast.scale == "e4m3_fp32":
        return _nvfp4(a, b, out)
    return _blocks_128(a, b, out)


def _mx(a: Side, b: Side, out: torch.dtype) -> torch.Tensor:
    qa, sa, _ = oriented(a)
    bt, sbt, _ = oriented(b.flipped())
    e8m0 = torch.float8_e8m0fnu
    call = KernelCall(
        qa.contiguous(),
        bt.contiguous().t(),
        to_blocked(sa).view(e8m0),
        to_blocked(sbt).view(e8m0),
        torch.bfloat16,
        recipe_a=("BlockWise1x32",),
        recipe_b=("BlockWise1x32",),
        swizzle_a=("SWIZZLE_32_4_4",),
        swizzle_b=("SWIZZLE_32_4_4",),
        blocks_a=_shape(sa),
        blocks_b=_shape(sbt),
    )
    return launch(call).to(out)


def _nvfp4(a: Side, b: Side, out: torch.dtype) -> torch.Tensor:
    qa, sa, ra = oriented(a)
    bt, sbt, rb = oriented(b.flipped())
    assert a.q.tensor_scale is not None and b.q.tensor_scale is not None
    swz = ("SWIZZLE_32_4_4", "NO_SWIZZLE")
    kinds = ("BlockWise1x16", "TensorWise")
    rows_a, rows_b = _per_row(sa, ra), _per_row(sbt, rb)
    call = KernelCall(
        pack_e2m1(qa),
        pack_e2m1(bt).t(),
        [to_blocked(rows_a).view(torch.float8_e4m3fn), a.q.tensor_scale],
        [to_blocked(rows_b).view(torch.float8_e4m3fn), b.q.tensor_scale],
        torch.bfloat16,
        recipe_a=kinds,
        recipe_b=kinds,
        swizzle_a=swz,
        swizzle_b=swz,
        blocks_a=_shape(rows_a),
        blocks_b=_shape(rows_b),
    )
    return launch(call).to(out)


def _blocks_128(a: Side, b: Side, out: torch.dtype) -> torch.Tensor:
    qa, sa, _ = oriented(a)
    bt, sbt, rb = oriented(b.flipped())
    if rb > 1:  # 128x128 weight blocks: K-major, the K blocks padded to a multiple of 4
        scale_b = F.pad(sbt, (0, -sbt.shape[1] % 4), value=1.0).contiguous().t()
        kind_b = "BlockWise128x128"
    else:  # 1x128: outer-dimension-major
        scale_b, kind_b = sbt.t().contiguous().t(), "BlockWise1x128"
    call = KernelCall(
        qa.contiguous(),
        bt.contiguous().t(),
        sa.t().contiguous().t(),
        scale_b,
        out,
        recipe_a=("BlockWise1x128",),
        recipe_b=(kind_b,),
    )
    return launch(call)
