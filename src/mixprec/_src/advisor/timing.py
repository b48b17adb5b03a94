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
from typing import Any

import torch
import torch.utils.flop_counter as flop_counter
from torch import nn

from mixprec._src.advisor.candidates import Candidate
from mixprec._src.advisor.formats import dtype_format, recipe_operands
from mixprec._src.advisor.gpus import GPU
from mixprec._src.advisor.report import StepTime
from mixprec._src.advisor.speed import Operands, Shape, Time, module_time
from mixprec._src.advisor.taps import Record


def gemm_shapes(module: nn.Module, record: Record) -> list[Shape] | None:
    """One shape per recorded call, None for a module without a GEMM."""
    shapes = []
    for outputs in record.outputs:
        if not outputs:
            return None
        shape = _shape(module, outputs[0])
        if shape is None:
            return None
        shapes.append(shape)
    return shapes or None


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


def _has_input_grad(record: Record) -> bool:
    return any(any(g is not None for g in call) for call in record.input_grads)


def operands(cand_word: str, cand: Candidate | None, region: torch.dtype) -> Operands | None:
    """The operand formats of a candidate (``cand``) or of the kept precision (``cand_word``
    alone: ``"fp32"`` or the region's dtype word)."""
    high = dtype_format(region)
    if cand is None:
        return Operands.uniform(dtype_format(torch.float32) if cand_word == "fp32" else high)
    if cand.recipe is not None:
        return recipe_operands(cand.recipe, high)
    assert cand.dtype is not None
    return Operands.uniform(dtype_format(cand.dtype))


def option_time(gpu: GPU, module: nn.Module, record: Record, ops: Operands | None) -> Time | None:
    """The module's time with ``ops``; None without a GEMM or when ``gpu`` cannot run it."""
    shapes = gemm_shapes(module, record)
    if shapes is None or ops is None:
        return None
    time = module_time(gpu, shapes, ops)
    if time is None or _has_input_grad(record):
        return time
    return Time(time.forward, 0.0, time.weight_grad, time.casts)


def step_time(
    gpu: GPU, baseline: Sequence[Time | None], chosen: Sequence[Time | None], other_flops: float
) -> StepTime:
    """Sum the modules' times (a module without a GEMM adds nothing)."""
    base = sum(t.total for t in baseline if t is not None)
    gemms = sum(t.gemms for t in chosen if t is not None)
    casts = sum(t.casts for t in chosen if t is not None)
    rate = gpu.rate("bf16")
    assert rate is not None
    other = other_flops / rate
    return StepTime(gpu.name, base + other, gemms + casts + other, gemms, casts, other)


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


def counted_flops(module: nn.Module, record: Record) -> float:
    """The FLOP the counter saw for a measured module's GEMMs in the reference pass."""
    shapes = gemm_shapes(module, record) or []
    per_call = 3 if _has_input_grad(record) else 2
    return float(sum(2 * s.m * s.k * s.n * s.groups * per_call for s in shapes))
