"""The matmul spellings the fp8 mode knows: the torch functions a recipe serves (each with its
parameters in torch's order, so keywords, methods, operators and aliases bind alike), those it
refuses on a weight, and how an error names each as the user spelled it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mixprec._src.torch_compat import mark_constant, public_attr

# The matmuls the recipe serves, each with its kind and its parameters in torch's order (a Tensor
# method's ``self`` first): every spelling (positional, keyword, method, operator, alias) is bound
# to these names in one place, ``_bind`` in :mod:`mixprec._src.fp8.hook`. ``product``: ``a @ b``;
# ``rproduct``: ``b @ a`` (``__rmatmul__``); ``addproduct``: ``beta * input + alpha * (a @ b)``.
PAIR, MM, MV = ("input", "other"), ("input", "mat2"), ("input", "vec")
OPS: dict[Any, tuple[str, tuple[str, ...]]] = {
    F.linear: ("linear", ("input", "weight", "bias")),
    torch.matmul: ("product", PAIR),
    torch.linalg.matmul: ("product", PAIR),
    torch.Tensor.matmul: ("product", PAIR),
    torch.Tensor.__matmul__: ("product", PAIR),
    torch.mm: ("product", MM),
    torch.Tensor.mm: ("product", MM),
    torch.mv: ("product", MV),
    torch.Tensor.mv: ("product", MV),
    torch.addmm: ("addproduct", ("input", "mat1", "mat2")),
    torch.Tensor.addmm: ("addproduct", ("input", "mat1", "mat2")),
    torch.addmv: ("addproduct", ("input", "mat", "vec")),
    torch.Tensor.addmv: ("addproduct", ("input", "mat", "vec")),
}
# ``Tensor.__rmatmul__`` is a Python function: compared with ``is``, never looked up in a dict
# (Dynamo's guard on it as a dict key fails on torch 2.13.0, "Guard failed on the same frame").
RMATMUL = torch.Tensor.__rmatmul__
SCALES = ("beta", "alpha")  # addmm/addmv's keyword-only factors
# Matmul-like ops the recipes cannot run with a weight operand: refused when one meets an
# activation (``F.conv*`` is ``torch.conv*``).
REFUSED = {
    *(torch.bmm, torch.baddbmm, torch.addbmm, torch.einsum, torch.tensordot, torch.inner),
    *(torch.outer, torch.ger, torch.dot, torch.vdot, torch.addr, torch.kron, torch.chain_matmul),
    *(torch.Tensor.bmm, torch.Tensor.baddbmm, torch.Tensor.addbmm, torch.Tensor.inner),
    *(torch.Tensor.outer, torch.Tensor.ger, torch.Tensor.dot, torch.Tensor.vdot),
    *(torch.Tensor.addr, torch.Tensor.kron),
    torch.linalg.vecdot,
    torch.linalg.multi_dot,
    *(F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d),
    F.bilinear,
    F.scaled_dot_product_attention,
    F.multi_head_attention_forward,
}


@mark_constant  # Dynamo runs it at trace time: it cannot trace str methods of a function's name
def label(func: Any) -> str:
    """How the user spelled ``func``."""
    if func is RMATMUL:
        return "Tensor.__rmatmul__"
    known = _LABELS.get(func)
    if known is not None:
        return known
    name = getattr(func, "__name__", repr(func))
    for prefix, space in (("F.", F), ("torch.", torch)):
        if public_attr(space, name, None) is func:
            return prefix + name
    return f"Tensor.{name}"


def _linalg_label(func: Any) -> str:
    name = func.__name__  # torch.linalg.vecdot's is linalg_vecdot
    short = name.removeprefix("linalg_")
    return (
        f"torch.linalg.{short}" if public_attr(torch.linalg, short, None) is func else label(func)
    )


# Made at import (Dynamo traces a dict lookup, not the string methods).
_LABELS: dict[Any, str] = {}
_LABELS.update({f: _linalg_label(f) for f in (*OPS, *REFUSED)})
