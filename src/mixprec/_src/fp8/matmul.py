"""The low-precision Linear: output, grad_input and grad_weight matmuls on cast operands.

One mechanism runs every recipe: each operand is cast per its :class:`~.recipes.Cast` along the
contraction dimension of the matmul it enters (``casts.quantize``), then multiplied on one of two
paths:

* emulated (every device): the cast values dequantized to fp32, an ordinary fp32 matmul, the
  result in the high-precision dtype: the values a block-scaled tensor core with fp32
  accumulation produces, at the cost of ordinary fp32 matmuls (a numerics simulator).
* hardware (:mod:`.kernels`): ``torch._scaled_mm`` where the device table says it is a fast
  kernel and the device's compute capability is in the recipe's range (tensorwise and rowwise
  from 8.9, 128-blocks on 9.x, MXFP8 and NVFP4 from 10.0), for shapes that are multiples of 16.
  Never on the CPU, where it runs oneDNN's reference kernel, thousands of times slower.

The token dimension is zero-padded to the blocks of the grad_weight matmul (which contracts
over it); the feature dimensions must be multiples of the recipe's blocks (checked by the hook).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mixprec._src import torch_compat
from mixprec._src.devices import caps
from mixprec._src.fp8 import kernels
from mixprec._src.fp8.carrier import gathered
from mixprec._src.fp8.casts import Quantized, cast_stats, dequantize, quantize
from mixprec._src.fp8.kernels import Side
from mixprec._src.fp8.recipes import E2M1, MATMULS, Cast, Recipe
from mixprec._src.fp8.stats import Slot
from mixprec.errors import ConfigError

_INPUT, _WEIGHT, _GRAD_OUTPUT = 0, 1, 2
_CAPABILITY: dict[str, tuple[int, int] | None] = {}


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of an NVIDIA device (cached), None elsewhere."""
    key = str(device)
    if key not in _CAPABILITY:
        found = None
        if device.type == "cuda" and torch.version.hip is None and torch.cuda.is_available():
            found = torch.cuda.get_device_capability(device)
        _CAPABILITY[key] = found
    return _CAPABILITY[key]


def use_scaled_mm(device: torch.device, recipe: Recipe | None = None) -> bool:
    """Whether ``recipe``'s matmuls on ``device`` take the hardware path (``torch._scaled_mm``);
    without a recipe, whether fp8 matmuls do at all.

    Example:
        >>> use_scaled_mm(torch.device("cpu"))
        False

    Host sync: none.
    """
    if recipe is not None and recipe.parts:
        return _parts_path(device, recipe)
    dry = kernels.target() if device.type == "meta" else None
    row = caps("cuda") if dry is not None else caps(device)
    if not row.fp8_scaled_mm or (recipe is not None and recipe.blocked and not row.block_scaled_mm):
        return False
    cap = _routed_capability(device)  # asked only where the row says fp8 kernels may exist
    low, high = recipe.capability if recipe is not None else ((8, 9), (99, 0))
    return cap is not None and low <= cap < high


def _routed_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability that routes ``device``'s matmuls: a dry run's GPU for meta
    tensors (:func:`.kernels.routed_as`), else the device's own."""
    found = kernels.target() if device.type == "meta" else None
    return found.capability if found is not None else _capability(device)


def _parts_path(device: torch.device, recipe: Recipe) -> bool:
    """A recipe put together per matmul: the hardware path if every low-precision matmul's
    recipe has it on ``device``, emulated if none has; a mix is refused (half the matmuls
    emulated would cost more than the whole recipe saves)."""
    paths = {
        matmul: use_scaled_mm(device, source)
        for matmul, source in zip(MATMULS, recipe.sources, strict=True)
        if source is not None
    }
    if len(set(paths.values())) == 1:
        return next(iter(paths.values()))
    cap = _routed_capability(device)
    on = [f"{m} ({recipe.parts[MATMULS.index(m)]})" for m in MATMULS if paths.get(m)]
    off = [
        f"{m} ({s.name}: compute capability {'.'.join(map(str, s.capability[0]))} to below "
        f"{'.'.join(map(str, s.capability[1]))})"
        for m, s in zip(MATMULS, recipe.sources, strict=True)
        if s is not None and not paths[m]
    ]
    raise ConfigError(
        f"recipe {recipe.name!r} cannot run on {device} (compute capability "
        f"{'.'.join(map(str, cap or ()))}): {', '.join(on)} would run in hardware but "
        f"{', '.join(off)} has no kernel here and would be emulated, thousands of times slower. "
        "Give those matmuls a recipe this GPU runs, or a high-precision dtype ('bf16')."
    )


@dataclass(frozen=True)
class Plan:
    """What one low-precision Linear call does: recipe, high-precision dtype, matmul path,
    stats slot, and the module's name (for messages)."""

    recipe: Recipe
    hp: torch.dtype
    scaled_mm: bool
    slot: Slot | None = None
    name: str = ""


def native_off(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Native autocast off for ``device``'s type; nothing on the meta device, which has no
    autocast (a dry run's tensors). Host sync: none."""
    if device.type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def _cast(
    plan: Plan,
    x: torch.Tensor,
    cast: Cast,
    dim: int,
    operand: int,
    first: bool,
    record: bool,
    elements: int | None = None,
) -> Quantized:
    """Quantize; record stats when a slot is bound and ``record`` (not a recomputation)."""
    q, src = quantize(x, cast, dim)
    if record and plan.slot is not None:
        real = x.numel() if elements is None else elements
        plan.slot.add(operand, cast_stats(src, q, cast, first, real, x))
    return q


def _values(side: Side) -> torch.Tensor:
    out = dequantize(side.q, side.cast)
    return out.t() if side.t else out


def _dims(a: Side, b: Side) -> tuple[int, int, int]:
    m, k = a.q.codes.shape[::-1] if a.t else a.q.codes.shape
    n = b.q.codes.shape[0] if b.t else b.q.codes.shape[1]
    return m, k, n


def _hardware_ok(plan: Plan, a: Side, b: Side) -> bool:
    return plan.scaled_mm and all(d % 16 == 0 for d in _dims(a, b))


def _site(plan: Plan, matmul: int) -> kernels.DryRunGpu | None:
    """The dry run in progress, told which module, matmul and recipe run next."""
    found = kernels.target()
    if found is not None:
        part = plan.recipe.parts[matmul] if plan.recipe.parts else plan.recipe.name
        found.site = (plan.name, MATMULS[matmul], part)
    return found


def _mm(
    plan: Plan, a: Side, b: Side, matmul: int, fast_accum: bool = False, count: bool = True
) -> torch.Tensor:
    """``a @ b`` on the hardware path where it applies, else emulated; counted per path."""
    hardware = _hardware_ok(plan, a, b)
    if count and plan.slot is not None:
        plan.slot.count_path(hardware)
    found = _site(plan, matmul)
    if not hardware:
        if found is not None:
            found.note("emulated", (plan.scaled_mm, _dims(a, b)))
        return torch.mm(_values(a), _values(b)).to(plan.hp)
    if a.cast.block[1] > 0:
        return kernels.block_mm(a, b, plan.hp)
    return kernels.tensor_row_mm(a, b, plan.hp, fast_accum)


def _hp_mm(
    plan: Plan,
    a: torch.Tensor,
    b: torch.Tensor,
    matmul: int,
    dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """A high-precision matmul as autocast runs it: the operands (and the output matmul's
    bias, fused as ``F.linear`` fuses it) rounded to ``dtype`` (None: the region's, in which
    the activations arrive), torch's matmul in that dtype, the result in the region's dtype."""
    dtype = dtype or plan.hp
    a, b = a.to(dtype), b.to(dtype)
    found = _site(plan, matmul)
    if found is not None:
        found.note("high", (a.dtype, (a.shape[0], a.shape[1], b.shape[1])))
    out = a.mm(b) if bias is None else torch.addmm(bias.to(dtype), a, b)
    return out.to(plan.hp)


def _shared(first: Cast | None, second: Cast | None) -> bool:
    """Whether an operand's cast for its first matmul serves its second too (the same square
    cast, so the same codes): cast once, saved for backward."""
    return first is not None and first == second and first.square


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, extra)) if extra else t


def _save(q: Quantized | None, hp: torch.Tensor, cast: Cast | None) -> tuple[Any, ...]:
    """What to keep of an operand: its cast (reused by the second matmul; fp4 codes packed two
    a byte) or itself."""
    if q is None:
        return hp, None, None, None
    codes = q.codes
    if cast is not None and cast.dtype == E2M1 and codes.shape[-1] % 2 == 0:
        codes = kernels.pack_e2m1(codes).view(torch.uint8)  # uint8: packed (codes are fp8)
    return codes, q.scale, q.tensor_scale, q.block


def _load(saved: tuple[Any, ...]) -> tuple[torch.Tensor | None, Quantized | None]:
    codes, scale, tensor_scale, block = saved
    if block is None:
        return codes, None
    if codes is not None and codes.dtype == torch.uint8:  # fp4 codes packed by _save
        codes = kernels.unpack_e2m1(codes)
    return None, Quantized(codes, scale, tensor_scale, scale, block)


class Fp8Linear(torch.autograd.Function):
    """``x2d @ weight.T`` on cast operands, and its gradients on cast operands, per the plan."""

    @staticmethod
    def forward(
        ctx: Any,
        x2d: torch.Tensor,
        weight: torch.Tensor,
        plan: Plan,
        bias: torch.Tensor | None = None,  # given only to a high-precision output matmul
    ) -> torch.Tensor:
        r = plan.recipe
        # A forward run inside backward is a checkpoint recomputation: its casts were recorded.
        record = plan.slot is not None and not torch_compat.running_backward()
        qx = qw = None
        if r.x is None or r.w is None:  # the output matmul in high precision
            out = _hp_mm(plan, x2d, weight.t(), 0, r.high[0], bias)
        else:
            qx = _cast(plan, x2d, r.x, 1, _INPUT, True, record)
            qw = gathered(weight, 1, r.w) or _cast(plan, weight, r.w, 1, _WEIGHT, True, record)
            out = _mm(plan, Side(qx, r.x), Side(qw, r.w, True), 0, fast_accum=True, count=record)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        keep_x = _save(qx if _shared(r.x, r.x_gw) else None, x2d, r.x)
        keep_w = _save(qw if _shared(r.w, r.w_gi) else None, weight, r.w)
        ctx.x_meta, ctx.w_meta = keep_x[3], keep_w[3]
        ctx.save_for_backward(
            *(keep_x[:3] if need_w else (None,) * 3),
            *(keep_w[:3] if need_x else (None,) * 3),
            weight,  # a reference only: lets a second differentiation find the weight
        )
        ctx.plan, ctx.wdtype, ctx.bias = plan, weight.dtype, bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Native autocast off here too: a compiled backward is traced under the forward's
        # autocast state, which would turn the fp32 matmuls of dequantized values into bf16 ones.
        saved = ctx.saved_tensors
        twice = torch.is_grad_enabled() and not torch.compiler.is_compiling()
        with native_off(dy.device), torch.no_grad():
            x = _load((*saved[0:3], ctx.x_meta))
            w = _load((*saved[3:6], ctx.w_meta))
            dx, dw = _backward(ctx.plan, ctx.needs_input_grad, dy, x, w, ctx.wdtype)
        if twice:  # create_graph=True: refuse a second differentiation instead of a wrong one
            weight = saved[6]
            dx = None if dx is None else _RefuseTwice.apply(dx, ctx.plan, dy, weight)
            dw = None if dw is None else _RefuseTwice.apply(dw, ctx.plan, dy, weight)
        db = dy.sum(0) if ctx.bias and ctx.needs_input_grad[3] else None  # as addmm's
        return dx, dw, None, db


def _backward(
    plan: Plan,
    needs: tuple[bool, ...],
    dy: torch.Tensor,
    x: tuple[torch.Tensor | None, Quantized | None],
    w: tuple[torch.Tensor | None, Quantized | None],
    wdtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    r = plan.recipe
    dy = dy.to(plan.hp)
    dx = dw = None
    qdy = None
    if needs[0]:
        w_hp, qw = w
        if r.dy_gi is None or r.w_gi is None:  # grad_input in high precision
            assert w_hp is not None
            dx = _hp_mm(plan, dy, w_hp, 1, r.high[1])
        else:
            qdy = _cast(plan, dy, r.dy_gi, 1, _GRAD_OUTPUT, True, True)
            if qw is None:
                assert w_hp is not None
                # (its inf/NaN counted here when the forward did not cast it: fprop in hp)
                first = r.w is None
                qw = gathered(w_hp, 0, r.w_gi) or _cast(plan, w_hp, r.w_gi, 0, _WEIGHT, first, True)
            dx = _mm(plan, Side(qdy, r.dy_gi), Side(qw, r.w_gi), 1)
    if needs[1]:
        x_hp, qx = x
        if r.dy_gw is None or r.x_gw is None:  # grad_weight in high precision
            assert x_hp is not None
            dw = _hp_mm(plan, dy.t(), x_hp.to(plan.hp), 2, r.high[2])
        else:
            rows = r.multiples()[0]  # the tokens, zero-padded to the blocks along them
            if qdy is None or not _shared(r.dy_gi, r.dy_gw):
                padded = _pad_rows(dy, rows)
                qdy = _cast(plan, padded, r.dy_gw, 0, _GRAD_OUTPUT, qdy is None, True, dy.numel())
            if qx is None:
                assert x_hp is not None
                padded = _pad_rows(x_hp, rows)
                qx = _cast(plan, padded, r.x_gw, 0, _INPUT, r.x is None, True, x_hp.numel())
            dw = _mm(plan, Side(qdy, r.dy_gw, True), Side(qx, r.x_gw), 2)
        dw = dw.to(wdtype)
    return dx, dw


class _RefuseTwice(torch.autograd.Function):
    """Passes a gradient through; differentiating it again raises (double backward)."""

    @staticmethod
    def forward(ctx: Any, grad: torch.Tensor, plan: Plan, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.plan = plan
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: Plan = ctx.plan
        where = f"Linear {plan.name!r}" if plan.name else "a Linear"
        raise ConfigError(
            f"double backward through {where} running recipe {plan.recipe.name!r}: its "
            "gradients come from low-precision matmuls on cast operands, whose own derivatives "
            "are not those of the Linear (a gradient penalty through them would be wrong). "
            "Keep that module in bf16 or fp32 for the pass that differentiates twice (e.g. "
            f"Policy('{plan.name or '<module>'}=bf16')), or compute the penalty outside the region."
        )


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: Plan
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the three matmuls cast per ``plan.recipe``, computed
    around in ``plan.hp``.

    ``x`` is cast to ``plan.hp`` (differentiably); ``weight`` is cast from its own dtype and gets
    its gradient in that dtype; the output and ``x``'s gradient are in ``plan.hp``. Native
    autocast is off inside (the matmuls' dtypes are the recipe's). An empty batch gives an empty
    output and zero gradients, as ``nn.Linear`` does.

    Example:
        >>> from mixprec._src.fp8.recipes import get_recipe
        >>> plan = Plan(get_recipe("tensorwise"), torch.float32, scaled_mm=False)
        >>> fp8_linear(torch.ones(2, 4), torch.ones(3, 4), None, plan)
        tensor([[4., 4., 4.],
                [4., 4., 4.]])

    Host sync: none.
    """
    with native_off(x.device):
        lead = x.shape[:-1]
        xh = x.to(plan.hp)
        x2d = xh.reshape(-1, x.shape[-1])
        # a high-precision output matmul adds the bias as F.linear does: fused (addmm) for a
        # 2-D or contiguous input, after the matmul otherwise
        high = plan.recipe.x is None and (x.dim() == 2 or (x.dim() > 2 and xh.is_contiguous()))
        fused = bias.to(plan.hp) if bias is not None and high else None
        if x2d.shape[0] == 0:  # nothing to scale: the plain matmul of no rows
            out = x2d.mm(weight.to(plan.hp).t())
            fused = None
        else:
            out = Fp8Linear.apply(x2d, weight, plan, fused)
        out = out.reshape(*lead, weight.shape[0])
        if bias is not None and fused is None:
            out = out + bias.to(plan.hp)
    return out
