"""The fp8 Linear: output, grad_input and grad_weight matmuls on dynamically scaled fp8 operands.

Two matmul paths compute ``a @ b`` from fp8 bits and scales:

* emulated (every device): dequantize to fp32 (``bits.float() / scale``), an ordinary fp32
  matmul, the result in the high-precision dtype. It is a numerics simulator: the values an fp8
  tensor core with fp32 accumulation produces, at the cost of ordinary fp32 matmuls.
* ``torch._scaled_mm``: where the device table says it is a fast kernel (CUDA) and the device
  supports fp8 (compute capability 8.9 or newer) and the shapes are multiples of 16. Never on the
  CPU, where it runs oneDNN's reference kernel, thousands of times slower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixprec._src.devices import caps
from mixprec._src.fp8.casts import cast_stats, dequantize, quantize
from mixprec._src.fp8.recipes import Cast, Recipe
from mixprec._src.fp8.stats import Slot

_INPUT, _WEIGHT, _GRAD_OUTPUT = 0, 1, 2
_FAST_OK: dict[str, bool] = {}


def _device_has_fp8(device: torch.device) -> bool:
    """Runtime check behind the table's ``fp8_scaled_mm`` column (cached per device)."""
    key = str(device)
    found = _FAST_OK.get(key)
    if found is None:
        found = False
        if device.type == "cuda" and torch.version.hip is None and torch.cuda.is_available():
            found = torch.cuda.get_device_capability(device) >= (8, 9)
        _FAST_OK[key] = found
    return found


def use_scaled_mm(device: torch.device) -> bool:
    """Whether fp8 matmuls on ``device`` go through ``torch._scaled_mm``.

    Example:
        >>> use_scaled_mm(torch.device("cpu"))
        False

    Host sync: none.
    """
    return caps(device).fp8_scaled_mm and _device_has_fp8(device)


@dataclass(frozen=True)
class Plan:
    """What one fp8 Linear call does: recipe, high-precision dtype, matmul path, stats slot."""

    recipe: Recipe
    hp: torch.dtype
    scaled_mm: bool
    slot: Slot | None = None


def _scaled_mm(
    qa: torch.Tensor,
    sa: torch.Tensor,
    qb: torch.Tensor,
    sb: torch.Tensor,
    out: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """``torch._scaled_mm`` on (M, K) row-major ``qa`` and (K, N) column-major ``qb``."""
    qa = qa.contiguous()
    qb = qb.t().contiguous().t()
    ia, ib = sa.reciprocal(), sb.reciprocal()
    rowwise = ia.dim() == 2 or ib.dim() == 2
    if rowwise:  # the rowwise kernel wants both scales as vectors
        ia = ia.reshape(-1, 1).expand(qa.shape[0], 1).contiguous()
        ib = ib.reshape(1, -1).expand(1, qb.shape[1]).contiguous()
    post = None
    if rowwise and not fast_accum:  # tensorwise kernel, scales applied after (as torchao does)
        post, ia, ib = ia * ib, ia.new_ones(()), ia.new_ones(())
    kernel_out = torch.bfloat16 if rowwise else out  # rowwise kernels write bf16 only
    res = torch._scaled_mm(
        qa, qb, scale_a=ia, scale_b=ib, out_dtype=kernel_out, use_fast_accum=fast_accum
    )
    if post is not None:
        res = res * post
    return res.to(out)


def _aligned(*sizes: int) -> bool:
    return all(s % 16 == 0 for s in sizes)


def _mm(
    plan: Plan,
    qa: torch.Tensor,
    sa: torch.Tensor,
    qb: torch.Tensor,
    sb: torch.Tensor,
    fast_accum: bool = False,
) -> torch.Tensor:
    if plan.scaled_mm and _aligned(qa.shape[0], qa.shape[1], qb.shape[1]):
        return _scaled_mm(qa, sa, qb, sb, plan.hp, fast_accum)
    return torch.mm(dequantize(qa, sa), dequantize(qb, sb)).to(plan.hp)


def _hp_mm(plan: Plan, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A high-precision matmul: native where fp8 is native; emulated, in fp32 then rounded (the
    values of a low-precision matmul with fp32 accumulation, and on the CPU several times faster
    than a bf16 matmul)."""
    if plan.scaled_mm:
        return a.mm(b)
    return a.float().mm(b.float()).to(plan.hp)


def _cast(
    plan: Plan, x: torch.Tensor, cast: Cast, dim: int, operand: int, first: bool, record: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize; record stats when a slot is bound and ``record`` (not a recomputation)."""
    bits, scale, a = quantize(x, cast, dim)
    if record and plan.slot is not None:
        plan.slot.add(operand, cast_stats(x, bits, scale, a, cast, first))
    return bits, scale


def _reusable(first: Cast | None, second: Cast | None) -> bool:
    """A tensorwise cast is the same for both matmuls an operand enters: cast once."""
    return first is not None and first == second and not first.rowwise


class Fp8Linear(torch.autograd.Function):
    """``x2d @ weight.T`` on fp8 operands, and its gradients on fp8 operands, per the plan."""

    @staticmethod
    def forward(ctx: Any, x2d: torch.Tensor, weight: torch.Tensor, plan: Plan) -> torch.Tensor:
        r = plan.recipe
        # A forward run inside backward is a checkpoint recomputation: its casts were recorded.
        record = plan.slot is not None and torch._C._current_graph_task_id() == -1
        assert r.x is not None and r.w is not None  # every recipe runs the output in fp8
        qx, sx = _cast(plan, x2d, r.x, 1, _INPUT, True, record)
        qw, sw = _cast(plan, weight, r.w, 1, _WEIGHT, True, record)
        out = _mm(plan, qx, sx, qw.t(), sw.t(), fast_accum=True)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        keep_x = (qx, sx) if _reusable(r.x, r.x_gw) else (x2d, None)
        keep_w = (qw, sw) if _reusable(r.w, r.w_gi) else (weight, None)
        ctx.save_for_backward(
            *(keep_x if need_w else (None, None)), *(keep_w if need_x else (None, None))
        )
        ctx.plan, ctx.wdtype = plan, weight.dtype
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Native autocast off here too: a compiled backward is traced under the forward's
        # autocast state, which would turn the fp32 matmuls of dequantized values into bf16 ones.
        with torch.autocast(dy.device.type, enabled=False):
            return Fp8Linear._backward(ctx, dy)

    @staticmethod
    def _backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: Plan = ctx.plan
        r = plan.recipe
        x_or_q, sx, w_or_q, sw = ctx.saved_tensors
        dy = dy.to(plan.hp)
        dx = dw = None
        reuse_dy = _reusable(r.dy_gi, r.dy_gw)
        qdy = sdy = None
        if ctx.needs_input_grad[0]:
            assert r.dy_gi is not None and r.w_gi is not None
            qdy, sdy = _cast(plan, dy, r.dy_gi, 1, _GRAD_OUTPUT, True, True)
            if sw is None:
                w_or_q, sw = _cast(plan, w_or_q, r.w_gi, 0, _WEIGHT, False, True)
            dx = _mm(plan, qdy, sdy, w_or_q, sw)
        if ctx.needs_input_grad[1]:
            if r.dy_gw is None or r.x_gw is None:  # grad_weight in high precision
                dw = _hp_mm(plan, dy.t(), x_or_q.to(plan.hp))
            else:
                if not (reuse_dy and qdy is not None):
                    qdy, sdy = _cast(plan, dy, r.dy_gw, 0, _GRAD_OUTPUT, qdy is None, True)
                if sx is None:
                    x_or_q, sx = _cast(plan, x_or_q, r.x_gw, 0, _INPUT, False, True)
                assert sdy is not None and qdy is not None
                dw = _mm(plan, qdy.t(), sdy.t(), x_or_q, sx)
            dw = dw.to(ctx.wdtype)
        return dx, dw, None


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: Plan
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the three matmuls in fp8, computed around in ``plan.hp``.

    ``x`` is cast to ``plan.hp`` (differentiably); ``weight`` is cast to fp8 from its own dtype
    and gets its gradient in that dtype; the output and ``x``'s gradient are in ``plan.hp``.
    Native autocast is off inside (the matmuls' dtypes are the recipe's).

    Example:
        >>> from mixprec._src.fp8.recipes import get_recipe
        >>> plan = Plan(get_recipe("tensorwise"), torch.float32, scaled_mm=False)
        >>> fp8_linear(torch.ones(2, 4), torch.ones(3, 4), None, plan)
        tensor([[4., 4., 4.],
                [4., 4., 4.]])

    Host sync: none.
    """
    with torch.autocast(x.device.type, enabled=False):
        lead = x.shape[:-1]
        x2d = x.to(plan.hp).reshape(-1, x.shape[-1])
        out = Fp8Linear.apply(x2d, weight, plan).reshape(*lead, weight.shape[0])
        if bias is not None:
            out = out + bias.to(plan.hp)
    return out
