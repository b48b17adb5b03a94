"""The oracle of the fp8 differential tests: a Linear under a recipe, written here from the recipe's
own functions (``casts.quantize`` / ``dequantize`` and the :class:`~mixprec._src.fp8.recipes.Recipe`
data), independently of the code under test (``fp8/matmul.py``, the hook, autocast).

It is the emulated path as the recipes define it: each of the three matmuls of ``y = x @ W.T``
multiplies its two operands cast per the recipe along the contraction dimension, dequantized to
float32, the product rounded to the high-precision dtype ``hp``; a matmul whose casts are None
(``rowwise_gw_hp``'s grad_weight) is torch's matmul of the ``hp`` operands in ``hp`` (as
autocast's matmul and torchao's high-precision grad_weight run it). The tokens are
zero-padded to the recipe's blocks for the grad_weight matmul. Stochastic rounding (NVFP4's
gradients) draws from torch's generator in the order the recipe names the casts: grad_input's
grad_output first, then grad_weight's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mixprec._src.fp8.casts import dequantize, quantize
from mixprec._src.fp8.recipes import Cast, Recipe, get_recipe


def _cast(t: torch.Tensor, cast: Cast, dim: int) -> torch.Tensor:
    """``t`` (2-D, contracting along ``dim``) as the recipe casts it, in float32."""
    q, _ = quantize(t, cast, dim)
    return dequantize(q, cast)


def _pad(t: torch.Tensor, multiple: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, -t.shape[0] % multiple))


class _Reference(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, r: Recipe, hp: torch.dtype) -> Any:
        assert r.x is not None and r.w is not None
        ctx.save_for_backward(x, w)
        ctx.r, ctx.hp = r, hp
        return torch.mm(_cast(x, r.x, 1), _cast(w, r.w, 1).t()).to(hp)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        with torch.autocast(dy.device.type, enabled=False):
            return _backward(ctx, dy)


def _backward(ctx: Any, dy: torch.Tensor) -> Any:
    x, w = ctx.saved_tensors
    r, hp = ctx.r, ctx.hp
    dy = dy.to(hp)
    dx = dw = None
    if ctx.needs_input_grad[0]:
        assert r.dy_gi is not None and r.w_gi is not None
        dx = torch.mm(_cast(dy, r.dy_gi, 1), _cast(w, r.w_gi, 0)).to(hp)
    if ctx.needs_input_grad[1]:
        if r.dy_gw is None or r.x_gw is None:
            dw = torch.mm(dy.t(), x.to(hp))  # autocast's matmul, in hp
        else:
            rows = r.multiples()[0]
            gy, gx = _cast(_pad(dy, rows), r.dy_gw, 0), _cast(_pad(x, rows), r.x_gw, 0)
            dw = torch.mm(gy.t(), gx).to(hp)
        dw = dw.to(w.dtype)
    return dx, dw, None, None


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, recipe: str, hp: torch.dtype
) -> torch.Tensor:
    """``F.linear(x, w, b)`` under ``recipe`` with ``hp`` around the matmuls: the input cast to
    ``hp``, the weight cast from its own dtype, the bias added in ``hp``.

    Example:
        >>> linear(torch.ones(2, 4), torch.ones(3, 4), None, "tensorwise", torch.float32)
        tensor([[4., 4., 4.],
                [4., 4., 4.]])
    """
    with torch.autocast(x.device.type, enabled=False):
        x2d = x.to(hp).reshape(-1, x.shape[-1])
        if x2d.shape[0] == 0 or w.numel() == 0:  # nothing to scale: as nn.Linear
            out = x2d.mm(w.to(hp).t())
        else:
            out = _Reference.apply(x2d, w, get_recipe(recipe), hp)
        out = out.reshape(*x.shape[:-1], w.shape[0])
        return out if b is None else out + b.to(hp)
