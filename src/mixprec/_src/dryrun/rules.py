"""The CUDA contract of one hardware matmul call, checked without a GPU.

Two checks per :class:`~mixprec._src.fp8.kernels.KernelCall`:

* torch's meta kernel: the call run on meta tensors, which torch's meta registrations check
  against CUDA's rules (A row-major, B column-major, K and N multiples of 16, scale shapes,
  strides and counts, the MX scale count padded to 128x4 tiles, ``SWIZZLE_32_4_4``, NVFP4's
  two-level scales);
* :data:`RULES`: what the meta kernels do not check and a GPU refuses (e5m2 x e5m2, a bias with
  fp32 output or of another dtype or size, fp4 with fast accumulation, and which compute
  capability has which kernel).

The content of swizzled block scales is held to an independent formula of cuBLAS's 128x4 layout
(:func:`swizzle_index`, :func:`check_swizzle`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mixprec._src.fp8.kernels import KernelCall

Capability = tuple[int, int]
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP4 = torch.float4_e2m1fn_x2


@dataclass(frozen=True)
class Broken:
    """A rule a kernel call breaks: its name, what is wrong, and the fix. Host sync: none."""

    rule: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.problem} (fix: {self.fix})"


def _cc(cap: Capability) -> str:
    return f"{cap[0]}.{cap[1]}"


def _kinds(call: KernelCall) -> set[str]:
    return set(call.recipe_a) | set(call.recipe_b)


def _arch_fp8(call: KernelCall, cap: Capability) -> str | None:
    if cap < (8, 9):
        return f"fp8/fp4 matmuls need compute capability 8.9 or newer, this GPU has {_cc(cap)}"
    return None


def _arch_128(call: KernelCall, cap: Capability) -> str | None:
    used = _kinds(call) & {"BlockWise1x128", "BlockWise128x128"}
    if used and not (9, 0) <= cap < (10, 0):
        return (
            f"{'/'.join(sorted(used))} scales run only on compute capability 9.x (cuBLASLt "
            f">= 12.9), this GPU has {_cc(cap)}"
        )
    return None


def _arch_mx(call: KernelCall, cap: Capability) -> str | None:
    used = _kinds(call) & {"BlockWise1x32", "BlockWise1x16"}
    if used and cap < (10, 0):
        return f"{'/'.join(sorted(used))} scales need compute capability 10.0, this has {_cc(cap)}"
    return None


def _e5m2_pair(call: KernelCall, cap: Capability) -> str | None:
    if call.a.dtype == call.b.dtype == torch.float8_e5m2:
        return "both operands are e5m2 (cuBLAS has no e5m2 x e5m2 fp8 matmul)"
    return None


def _bias(call: KernelCall, cap: Capability) -> str | None:
    if call.bias is None:
        return None
    if call.out_dtype == torch.float32:
        return "a bias with fp32 output (cuBLAS takes a bias only with a 16-bit output)"
    if call.bias.dtype != call.out_dtype:
        return f"a {call.bias.dtype} bias with {call.out_dtype} output (they must match)"
    if call.bias.shape != (call.b.shape[1],):
        return f"a bias of shape {tuple(call.bias.shape)}, not ({call.b.shape[1]},)"
    return None


def _fp4_fast(call: KernelCall, cap: Capability) -> str | None:
    if call.fast_accum and _FP4 in (call.a.dtype, call.b.dtype):
        return "fp4 operands with fast accumulation (the fp4 kernels have none)"
    return None


def _mx_count(call: KernelCall, cap: Capability) -> str | None:
    """Each swizzled block scale holds the operand's (rows, K / block) scales padded to 128 x 4
    tiles (torch 2.13's meta kernel checks the count, 2.14.1's does not)."""
    k = call.a.shape[1] * (2 if call.a.dtype == _FP4 else 1)
    for side, rows, kinds, swizzles, scale in (
        ("A", call.a.shape[0], call.recipe_a, call.swizzle_a, call.scale_a),
        ("B", call.b.shape[1], call.recipe_b, call.swizzle_b, call.scale_b),
    ):
        block = {"BlockWise1x32": 32, "BlockWise1x16": 16}.get(kinds[0] if kinds else "")
        if block is None or not swizzles or swizzles[0] != "SWIZZLE_32_4_4":
            continue
        first = scale[0] if isinstance(scale, (list, tuple)) else scale
        want = (-(-rows // 128) * 128) * (-(-(k // block) // 4) * 4)
        if first.numel() != want:
            return f"{side}'s {kinds[0]} scale holds {first.numel()} values, not {want}"
    return None


#: The CUDA rules torch's meta kernels do not check: (name, check, fix).
RULES: tuple[tuple[str, Callable[[KernelCall, Capability], str | None], str], ...] = (
    ("arch_fp8", _arch_fp8, "keep the module in bf16 on this GPU"),
    ("arch_128_blocks", _arch_128, "use fp8:rowwise, or mxfp8 on a Blackwell GPU"),
    ("arch_mx_nvfp4", _arch_mx, "use fp8 or fp8:rowwise (or fp8:blockwise) on Hopper"),
    ("e5m2_x_e5m2", _e5m2_pair, "cast one operand to e4m3"),
    ("bias", _bias, "add the bias after the matmul, in the output's dtype"),
    ("fp4_fast_accum", _fp4_fast, "call the fp4 kernel without use_fast_accum"),
    ("mx_scale_count", _mx_count, "pad the scales to 128x4 tiles, then swizzle (to_blocked)"),
)


def meta_check(call: KernelCall) -> tuple[torch.Tensor, Broken | None]:
    """``call`` run by torch's meta kernel (its tensors on the meta device): the output, or
    an empty one of the expected shape and the rule broken.

    Host sync: none.
    """
    try:
        return call.run(), None
    except (RuntimeError, ValueError, TypeError) as err:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        out = torch.empty(call.a.shape[0], call.b.shape[1], dtype=call.out_dtype, device="meta")
        return out, Broken("meta_kernel", text, _fix_for(text))


def _fix_for(text: str) -> str:
    if "divisible by 16" in text or "multiple of 16" in text:
        return "pad tokens (and features) to a multiple of 16, or keep the module in bf16"
    if "major" in text or "stride" in text:
        return "pass A row-major and B column-major (b.t() of a contiguous (N, K) tensor)"
    if "scale" in text:
        return "lay the scales out as the scaling type needs (128x4 swizzled for MX/NVFP4)"
    return "keep the module in bf16, or another recipe"


def check(call: KernelCall, cap: Capability) -> tuple[torch.Tensor, list[Broken]]:
    """Every check of one call on a GPU of compute capability ``cap``: the meta kernel's,
    then :data:`RULES`. Returns the output (meta) and the rules broken.

    Example:
        >>> e5 = torch.empty(32, 32, dtype=torch.float8_e5m2, device="meta")
        >>> one = torch.ones((), device="meta")
        >>> call = KernelCall(e5, e5.t(), one, one, torch.bfloat16)
        >>> [b.rule for b in check(call, (9, 0))[1]]
        ['e5m2_x_e5m2']

    Host sync: none.
    """
    out, broken = meta_check(call)
    found = [] if broken is None else [broken]
    for name, rule, fix in RULES:
        problem = rule(call, cap)
        if problem is not None:
            found.append(Broken(name, problem, fix))
    return out, found


def swizzle_index(rows: int, cols: int) -> torch.Tensor:
    """For a (rows, cols) block-scale matrix, the flat position each element takes in cuBLAS's
    128x4 swizzled layout (padded to 128 x 4 tiles, tiles in row-major order of
    ``(r // 128, c // 4)``): ``tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4``.

    Example:
        >>> swizzle_index(2, 2).tolist()
        [[0, 1], [16, 17]]

    Host sync: none.
    """
    r = torch.arange(rows).reshape(-1, 1)
    c = torch.arange(cols).reshape(1, -1)
    tiles_across = -(-cols // 4)
    tile = (r // 128) * tiles_across + c // 4
    return tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4


def check_swizzle(logical: torch.Tensor, passed: torch.Tensor) -> Broken | None:
    """Whether ``passed`` (the flat scale a kernel is given) holds ``logical`` (the
    (rows, cols) block scales) where cuBLAS's 128x4 layout reads each, and the padding to
    whole tiles. On CPU tensors.

    Example:
        >>> from mixprec._src.fp8.kernels import to_blocked
        >>> s = torch.arange(6.0).reshape(2, 3)
        >>> check_swizzle(s, to_blocked(s)) is None, check_swizzle(s, s.flatten()) is None
        (True, False)

    Host sync: compares on the host (a check, not a hot path).
    """
    rows, cols = logical.shape
    need = -(-rows // 128) * 128 * (-(-cols // 4) * 4)
    flat = passed.reshape(-1)
    if flat.numel() != need:
        return Broken(
            "swizzle_content",
            f"{flat.numel()} scales for a {rows}x{cols} block-scale matrix, cuBLAS reads {need}",
            "pad the scales to 128x4 tiles, then swizzle (kernels.to_blocked)",
        )
    index = swizzle_index(rows, cols).reshape(-1)
    if not torch.equal(flat[index], logical.reshape(-1).to(flat.dtype)):
        return Broken(
            "swizzle_content",
            f"the {rows}x{cols} block scales are not where cuBLAS's 128x4 layout reads them",
            "swizzle the padded scales (kernels.to_blocked)",
        )
    return None
