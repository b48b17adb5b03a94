"""The speed model applied to measured modules: their GEMM shapes and each option's time.

The shapes come from the float32 reference pass: an ``nn.Linear`` that returned ``(..., N)``
ran ``M = numel / N`` rows of ``K = in_features``; a convolution is its implicit GEMM (rows: the
batch times the output positions; ``K``: input channels per group times the kernel size). A
module whose input needed no gradient runs no input-gradient GEMM. Other modules have no
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

from mixprec._src.advisor.measure.taps import Record
from mixprec._src.advisor.report.advice import StepTime
from mixprec._src.advisor.speed.gpus import GPU
from mixprec._src.advisor.speed.model import Operands, Shape, Time, module_time


@dataclass(frozen=True)
class Gemms:
    """A module's GEMMs in one step, as the reference pass saw them: one shape per call, and
    whether an input needed a gradient (else no input-gradient GEMM runs)."""

    calls: tuple[Shape, ...]
    input_grad: bool


def gemm_shapes(module: nn.Module, record: Record) -> Gemms | None:
    """The module's GEMMs, None for a module without one."""
    shapes = []
    for outputs in record.outputs:
        if not outputs:
            return None
        shape = _shape(module, outputs[0])
        if shape is None:
            return None
        shapes.append(shape)
    return Gemms(tuple(shapes), record.has_input_grad) if shapes else None


def _shape(module: nn.Module, out: torch.Tensor) -> Shape | None:
    if isinstance(module, nn.Linear):
        n = module.out_features
        return Shape(out.numel() // max(n, 1), module.in_features, n)
    if isinstance(module, nn.modules.conv._ConvNd):
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
    return module_time(gpu, gemms.calls, ops, gemms.input_grad)


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


def _sdpa(q: Any, k: Any, v: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return int(flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape))


def _sdpa_backward(
    g: Any, q: Any, k: Any, v: Any, *args: Any, out_val: Any = None, **kwargs: Any
) -> int:
    return int(flop_counter.sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape))


def _cpu_attention() -> dict[Any, Any]:
    """torch's counter has no formula for the CPU flash-attention kernels: they are given the
    formulas of the other attention kernels."""
    aten = torch.ops.aten
    found = {}
    for name, fn in (("", _sdpa), ("_backward", _sdpa_backward)):
        op = getattr(aten, f"_scaled_dot_product_flash_attention_for_cpu{name}", None)
        if op is not None:
            setattr(fn, "_get_raw", True)  # noqa: B010 (torch reads this flag)
            found[op] = fn
    return found


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
    per_call = 3 if gemms.input_grad else 2
    return float(sum(2 * s.m * s.k * s.n * s.groups * per_call for s in gemms.calls))
