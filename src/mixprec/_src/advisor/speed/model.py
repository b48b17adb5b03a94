"""The speed model: a module's three GEMMs and its casts, predicted on a target GPU.

A module with a matmul (``nn.Linear``; ``nn.Conv*`` as its implicit GEMM) runs three GEMMs per
training step: the output (``M x K @ K x N``), the input gradient (``M x N @ N x K``) and the
weight gradient (``K x M @ M x N``), ``M`` the rows (tokens, or output positions of a conv),
``K`` the input features, ``N`` the output features. Each GEMM takes the longer of its compute
time (``2 M K N`` FLOP at the achievable rate of its operands' kind) and its memory time (its
operands and output at the achievable bandwidth), and never less than the shortest kernel.

In low precision the operands are cast first. Each of the three tensors (input ``x``, weight
``w``, output gradient ``dy``) is read once from the region's 16-bit dtype and written once per
quantized copy the recipe needs (one per GEMM it enters), with its scales; a per-tensor scale,
or a scale over a whole column (an operand whose contraction runs along the tensor's first
dimension, scaled per row of that contraction), needs the amax before anything is written: one
more read. Block scales (16, 32, 128 elements) are local to a tile and cost no extra read. This
is the traffic of fused cast kernels (TransformerEngine's, or torchao's under torch.compile);
eager casts move more. Everything else in a step (attention, norms, the optimizer) is outside
the model, except the matmuls the advisor counts in its reference pass (see ``Step``).

The speed model applied to measured modules: their GEMM shapes and each option's time.

The shapes come from the float32 reference pass: an ``nn.Linear`` that returned ``(..., N)``
ran ``M = numel / N`` rows of ``K = in_features``; a convolution is its implicit GEMM (rows: the
batch times the output positions; ``K``: input channels per group times the kernel size). A
call whose input needed no gradient runs no input-gradient GEMM. Other modules have no
predicted time. The rest of the step's matmuls (attention's, a functional ``F.linear``) are
counted with torch's ``FlopCounterMode`` during the reference pass and timed in 16-bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.flop_counter as flop_counter
from torch import nn

from mixprec._src.advisor.speed.gpus import GPU, KERNEL_FLOOR_S
from mixprec._src.torch_compat import CONV_BASE, cpu_flash_attention_formulas

ROW = 0  #: ``Format.block`` for one scale per row of the contraction (axis-wise, "rowwise")


@dataclass(frozen=True)
class Format:
    """How one GEMM operand is stored: the tensor-core kind it runs on and its bytes.

    Attributes:
        kind: ``"fp32"``, ``"bf16"`` (fp16 alike), ``"fp8"`` or ``"fp4"``.
        bits: bits per element in memory.
        block: elements per scale along the contraction (``ROW``: the whole contraction;
            None: one scale for the tensor, or no scale for 16/32-bit operands).
        scale_bytes: bytes per scale (fp32 4, E8M0 or E4M3 1).
        tile: rows across the contraction that share a scale (2D blocks: 128 for DeepSeek's
            128 x 128 weight blocks, 16 for NVFP4's 16 x 16), else 1.
        tensor_scale: also one scale for the whole tensor (NVFP4's second level), whose amax
            needs a pass of its own.
    """

    kind: str
    bits: int
    block: int | None = None
    scale_bytes: int = 0
    tile: int = 1
    tensor_scale: bool = False

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    def scales(self, numel: int, contraction: int) -> float:
        """Bytes of scales for ``numel`` elements contracted over ``contraction``."""
        if not self.quantized:
            return 0.0
        if self.block is None:
            return float(self.scale_bytes)
        per = contraction if self.block == ROW else self.block * self.tile
        return numel / max(per, 1) * self.scale_bytes

    def needs_pass(self, along_rows: bool) -> bool:
        """Whether its amax must be known before the cast writes anything (one more read)."""
        if not self.quantized:
            return False
        return self.tensor_scale or self.block is None or (self.block == ROW and along_rows)


BF16 = Format("bf16", 16)
FP32 = Format("fp32", 32)


#: CUDA compute capabilities ``(lowest, above the highest)`` a recipe's hardware matmuls run on.
ANY_GPU = ((0, 0), (99, 0))


@dataclass(frozen=True)
class Operands:
    """The formats of the six (GEMM, operand) pairs of a module; see ``fp8.recipes.Recipe``.

    ``x``/``w``: forward; ``dy_gi``/``w_gi``: input gradient; ``dy_gw``/``x_gw``: weight
    gradient; ``capability``: where the recipe has a hardware path (elsewhere it is emulated,
    which the model does not time).
    """

    x: Format
    w: Format
    dy_gi: Format
    w_gi: Format
    dy_gw: Format
    x_gw: Format
    capability: tuple[tuple[int, int], tuple[int, int]] = ANY_GPU

    @classmethod
    def uniform(cls, fmt: Format) -> Operands:
        return cls(fmt, fmt, fmt, fmt, fmt, fmt)


@dataclass(frozen=True)
class Time:
    """Predicted seconds of one module per training step (summed over its calls).

    Attributes:
        forward: the output GEMM.
        input_grad: the input-gradient GEMM.
        weight_grad: the weight-gradient GEMM.
        casts: the cast kernels of its operands.
    """

    forward: float
    input_grad: float
    weight_grad: float
    casts: float

    @property
    def gemms(self) -> float:
        """The three GEMMs together. Host sync: none."""
        return self.forward + self.input_grad + self.weight_grad

    @property
    def total(self) -> float:
        """GEMMs and casts. Host sync: none."""
        return self.gemms + self.casts

    def __add__(self, other: Time) -> Time:
        return Time(
            self.forward + other.forward,
            self.input_grad + other.input_grad,
            self.weight_grad + other.weight_grad,
            self.casts + other.casts,
        )


@dataclass(frozen=True)
class StepTime:
    """The predicted time of a training step's matmuls on a GPU.

    Attributes:
        gpu: the GPU's name.
        baseline: seconds with every measured module in the region's 16-bit dtype (bf16).
        proposal: seconds with the proposal.
        gemms: of ``proposal``, the measured modules' GEMMs.
        casts: of ``proposal``, their casts (fp8 operands, the inputs of fp32 islands).
        other: the step's other matmuls (attention, functional matmuls) in 16-bit, in both;
            elementwise ops, norms, the optimizer and communication are not modelled.
        left_out: the measured modules without a predicted time (no GEMM the model knows),
            in neither sum.
    """

    gpu: str
    baseline: float
    proposal: float
    gemms: float
    casts: float
    other: float
    left_out: tuple[str, ...] = ()

    @property
    def speedup(self) -> float:
        """``baseline / proposal``. Host sync: none."""
        return self.baseline / self.proposal if self.proposal > 0 else 1.0


ZERO = Time(0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Shape:
    """One call's GEMM: ``M x K @ K x N``, ``groups`` of them (grouped convolutions)."""

    m: int
    k: int
    n: int
    groups: int = 1


def gemm_s(gpu: GPU, m: int, k: int, n: int, a: Format, b: Format) -> float | None:
    """Seconds of one ``m x k @ k x n`` GEMM (16-bit output), None if ``gpu`` cannot run it."""
    kind = a.kind if a.bits <= b.bits else b.kind
    rate = gpu.rate(kind)
    if rate is None:
        return None
    compute = 2.0 * m * k * n / rate
    data = m * k * a.bits / 8 + a.scales(m * k, k) + k * n * b.bits / 8 + b.scales(k * n, k)
    data += m * n * max(a.bits, b.bits, 16) / 8
    return max(compute, data / gpu.memory_rate, KERNEL_FLOOR_S)


def cast_s(gpu: GPU, rows: int, cols: int, copies: Sequence[tuple[Format, bool]]) -> float:
    """Seconds to cast one ``rows x cols`` 16-bit tensor into its quantized ``copies``, each
    ``(format, contracted along rows)``: one read, one write per copy, one more read first when
    a copy needs its amax before writing (see the module docstring)."""
    quantized = [(f, along) for f, along in copies if f.quantized]
    if not quantized:
        return 0.0
    numel = rows * cols
    data = 2.0 * numel
    for fmt, along_rows in quantized:
        data += numel * fmt.bits / 8 + fmt.scales(numel, rows if along_rows else cols)
    kernels = [data]
    if any(f.needs_pass(along) for f, along in quantized):
        kernels.append(2.0 * numel)
    return sum(max(b / gpu.memory_rate, KERNEL_FLOOR_S) for b in kernels)


def _upcast_s(gpu: GPU, numel: int) -> float:
    """An fp32 island's 16-bit input, cast up (autocast's cast: one read, one write)."""
    return max(6.0 * numel / gpu.memory_rate, KERNEL_FLOOR_S)


def module_time(
    gpu: GPU, shapes: Sequence[Shape], ops: Operands, input_grad: bool = True
) -> Time | None:
    """A module's predicted time over its calls, None if ``gpu`` cannot run ``ops``. Without
    ``input_grad`` (no input of the module needs a gradient) the input-gradient GEMM does not
    run, and neither do the casts of its operands."""
    if not runs(gpu, ops):
        return None
    total = ZERO
    for s in shapes:
        m, k, n = s.m, s.k, s.n
        fwd = gemm_s(gpu, m, k, n, ops.x, ops.w)
        gi = gemm_s(gpu, m, n, k, ops.dy_gi, ops.w_gi) if input_grad else 0.0
        gw = gemm_s(gpu, k, m, n, ops.x_gw, ops.dy_gw)
        if fwd is None or gi is None or gw is None:
            return None
        w_copies, dy_copies = [(ops.w, False)], [(ops.dy_gw, True)]
        if input_grad:
            w_copies.append((ops.w_gi, True))
            dy_copies.insert(0, (ops.dy_gi, False))
        casts = cast_s(gpu, m, k, [(ops.x, False), (ops.x_gw, True)])
        casts += cast_s(gpu, n, k, w_copies) + cast_s(gpu, m, n, dy_copies)
        if ops.x.kind == "fp32":
            casts += _upcast_s(gpu, m * k)
        g = s.groups
        total = total + Time(fwd * g, gi * g, gw * g, casts * g)
    return total


def runs(gpu: GPU, ops: Operands) -> bool:
    """Whether ``gpu`` runs ``ops``'s matmuls in hardware (its compute capability is in the
    recipe's range). Host sync: none."""
    low, high = ops.capability
    return low <= gpu.capability < high


@dataclass(frozen=True)
class Gemms:
    """A module's GEMMs in one step, as the reference pass saw them: one shape per call, and
    per call whether an input needed a gradient (else that call runs no input-gradient GEMM)."""

    calls: tuple[Shape, ...]
    input_grad: tuple[bool, ...]


def gemm_shapes(
    module: nn.Module,
    outputs_per_call: Sequence[Sequence[torch.Tensor]],
    input_grad: Sequence[bool],
) -> Gemms | None:
    """The module's GEMMs from its floating outputs in each call (``input_grad``: per call,
    whether an input needed a gradient), None without a GEMM."""
    shapes = []
    for outputs in outputs_per_call:
        if not outputs:
            return None
        shape = _shape(module, outputs[0])
        if shape is None:
            return None
        shapes.append(shape)
    return Gemms(tuple(shapes), tuple(input_grad)) if shapes else None


def _shape(module: nn.Module, out: torch.Tensor) -> Shape | None:
    if isinstance(module, nn.Linear):
        n = module.out_features
        return Shape(out.numel() // max(n, 1), module.in_features, n)
    if isinstance(module, CONV_BASE):
        groups = module.groups
        batched = out.dim() > len(module.kernel_size) + 1
        rows = out.numel() // max(out.shape[1 if batched else 0], 1)
        k = module.in_channels // groups * math.prod(module.kernel_size)
        return Shape(rows, k, module.out_channels // groups, groups)
    return None


def predict(gpu: GPU, gemms: Gemms | None, ops: Operands) -> Time | None:
    """The module's time with ``ops``; None without a GEMM or when ``gpu`` cannot run it."""
    if gemms is None:
        return None
    total = ZERO
    for shape, input_grad in zip(gemms.calls, gemms.input_grad, strict=True):
        time = module_time(gpu, [shape], ops, input_grad)
        if time is None:
            return None
        total = total + time
    return total


def step_time(
    gpu: GPU, rows: Sequence[tuple[str, Time | None, Time | None]], other_flops: float
) -> StepTime:
    """Sum the modules' times, each row ``(name, in bf16, in the proposal)``; a module without
    a predicted time adds nothing, and the step says it left it out."""
    base = sum(b.total for _, b, _ in rows if b is not None)
    gemms = sum(c.gemms for _, _, c in rows if c is not None)
    casts = sum(c.casts for _, _, c in rows if c is not None)
    rate = gpu.rate("bf16")
    assert rate is not None
    other = other_flops / rate
    left_out = tuple(name for name, b, c in rows if b is None or c is None)
    return StepTime(gpu.name, base + other, gemms + casts + other, gemms, casts, other, left_out)


def time_budget(baseline: float, searched: float, min_speedup: float) -> float:
    """The seconds modules whose bf16 time is ``searched`` may take together for a step of
    ``baseline`` seconds in bf16 to run ``min_speedup`` times faster (the rest unchanged).

    Example:
        >>> time_budget(10.0, 8.0, 2.0)  # the other 2 s stay: 3 s left for the 8 s of bf16
        3.0

    Host sync: none.
    """
    return baseline / min_speedup - (baseline - searched)


def _sdpa(q: Any, k: Any, v: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return int(flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape))


def _sdpa_backward(
    g: Any, q: Any, k: Any, v: Any, *args: Any, out_val: Any = None, **kwargs: Any
) -> int:
    return int(flop_counter.sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape))


def _cpu_attention() -> dict[Any, Any]:
    """torch's counter has no formula for the CPU flash-attention kernels: they are given the
    formulas of the other attention kernels."""
    return cpu_flash_attention_formulas(_sdpa, _sdpa_backward)


class FlopCount:
    """The matmul FLOP of a pass (forward and backward), read after it. Host sync: none."""

    def __init__(self) -> None:
        self.total = 0


@contextmanager
def counting(count: FlopCount | None) -> Iterator[None]:
    """Count the matmul FLOP of what runs inside into ``count`` (nothing if None)."""
    if count is None:
        yield
        return
    mode = flop_counter.FlopCounterMode(display=False, custom_mapping=_cpu_attention())
    with mode:
        yield
    count.total += int(mode.get_total_flops())


def counted_flops(gemms: Gemms | None) -> float:
    """The FLOP the counter saw for a measured module's GEMMs in the reference pass."""
    if gemms is None:
        return 0.0
    calls = zip(gemms.calls, gemms.input_grad, strict=True)
    return float(sum(2 * s.m * s.k * s.n * s.groups * (3 if g else 2) for s, g in calls))
