"""Op rules: a narrowly scoped ``TorchFunctionMode``, pushed only while op rules are active.

It matches public Python functions by name (``torch.x``, ``torch.nn.functional.x``, ``Tensor.x``),
casts above autograd (so casts are differentiable, as native autocast's are) and runs the call with
native autocast off for the region's device. Calls made inside a Python function it intercepted,
and ops inside natively wrapped composites, are not seen (see docs/autocast.md). A rule that
applies inside a checkpointed forward makes that checkpoint recompute under the same mode
(:mod:`._recompute`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mixprec._src.autocast._casting import (
    cast_tree,
    cast_value,
    first_floating_dtype,
    promote_dtype,
    run_without_autocast,
)
from mixprec._src.autocast._recompute import current_checkpoint, replay_in
from mixprec._src.autocast.rules import Rule


def apply_op_rule(
    func: Callable[..., Any],
    rule: Rule,
    device_type: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run ``func`` under ``rule``: cast eligible inputs, autocast off inside, cast the output.

    Example:
        >>> import torch
        >>> from mixprec import Rule
        >>> from mixprec._src.autocast._ops import apply_op_rule
        >>> x = torch.ones(2, dtype=torch.bfloat16)
        >>> apply_op_rule(torch.exp, Rule("fp32"), "cpu", (x,), {}).dtype
        torch.float32

    Host sync: none.
    """
    low = torch.get_autocast_dtype(device_type)
    in_dtype = first_floating_dtype(args, kwargs)
    if rule.compute == "promote":
        target = promote_dtype(args, kwargs, device_type)
    else:
        target = rule.compute_dtype(low)
    if target is not None:
        args, kwargs = cast_tree(args, kwargs, device_type, target)
    out = run_without_autocast(device_type, func, *args, **kwargs)
    out_dtype = rule.output_dtype(low, in_dtype)
    if out_dtype is not None:
        out = cast_value(out, device_type, out_dtype)
    return out


class OpRuleMode(TorchFunctionMode):
    """Applies a name -> rule table to torch function calls while native autocast is on.

    Args:
        table: Python op name (``"softmax"``) -> rule.
        device_type: the region's device type.

    Example:
        >>> import torch
        >>> from mixprec import Rule
        >>> from mixprec._src.autocast._ops import OpRuleMode
        >>> mode = OpRuleMode({"mm": Rule("fp32")}, "cpu")
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), mode:
        ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.float32

    Host sync: none.
    """

    def __init__(self, table: Mapping[str, Rule], device_type: str) -> None:
        super().__init__()
        self.table = table
        self.device_type = device_type
        # The checkpoint whose forward creates this mode (its recompute creates it again).
        self.home = None if torch.compiler.is_compiling() else current_checkpoint()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        rule = self.table.get(getattr(func, "__name__", ""))
        if rule is None or not torch.is_autocast_enabled(self.device_type):
            return func(*args, **kwargs)
        if not torch.compiler.is_compiling():  # compiled graphs recompute as traced
            target = current_checkpoint()
            if target is not None and (self.home is None or target[0] is not self.home[0]):
                replay_in(target, self.table, self.device_type, OpRuleMode)
        return apply_op_rule(func, rule, self.device_type, args, kwargs)
