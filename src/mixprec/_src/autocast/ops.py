"""Op rules: a narrowly scoped ``TorchFunctionMode``, and their replay in checkpoint recomputation.

The mode is pushed only while op rules are active. It matches public Python functions by name
(``torch.x``, ``torch.nn.functional.x``, ``Tensor.x``), casts above autograd (so casts are
differentiable, as native autocast's are) and runs the call with native autocast off for the
region's device. Calls made inside a Python function it intercepted, and ops inside natively
wrapped composites, are not seen (see docs/autocast.md).

**Replay.** ``torch.utils.checkpoint`` recomputes a function in backward, outside the region,
restoring native autocast but not this mode, so a recompute would run the ops without their rules
(non-reentrant checkpoint then fails its metadata check; reentrant checkpoint silently computes
different gradients). When an op rule applies inside a checkpointed forward, the mode wraps that
checkpoint's recompute function so that it runs under the same rule table. Module rules replay
the same way: the first module call inside a checkpoint's forward wraps its recompute function with
the forward's context (:func:`capture_for_recompute`, :class:`.modules.ForwardContext`).

Finding a running checkpoint and replacing its recompute function reads private parts of
``torch.utils.checkpoint``: torch_compat does it (:func:`~mixprec._src.torch_compat.
running_checkpoints`, ``recompute_function``, ``set_recompute_function``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mixprec._src.autocast.casting import (
    cast_tree,
    cast_value,
    first_floating_dtype,
    promote_dtype,
    run_without_autocast,
)
from mixprec._src.autocast.native import backward_autocast_off_while_tracing, never_compiled_alone
from mixprec._src.autocast.rules import Rule
from mixprec._src.torch_compat import (
    CheckpointTarget,
    mark_constant,
    recompute_function,
    running_checkpoints,
    set_recompute_function,
)

# ---------------------------------------------------------------- checkpoint replay
_REPLAYS = "_mixprec_replays"  # attribute of a wrapper: the tables it replays


def current_checkpoint() -> CheckpointTarget | None:
    """The innermost checkpoint whose forward is running now, or None.

    Example:
        >>> current_checkpoint() is None
        True

    Host sync: none.
    """
    found = running_checkpoints()
    return found[0] if found else None


def replay_in(target: CheckpointTarget, table: Mapping[str, Rule], device_type: str) -> None:
    """Make the checkpoint ``target`` recompute under the op rules ``table`` (once per table).

    Example:
        >>> class Holder:
        ...     run_function = staticmethod(lambda: torch.exp(torch.zeros(1)).dtype)
        >>> h = Holder()
        >>> replay_in((h, "run_function"), {"exp": Rule("low")}, "cpu")
        >>> with torch.autocast("cpu", torch.bfloat16):
        ...     h.run_function()
        torch.bfloat16

    Host sync: none.
    """
    fn = recompute_function(target)
    replays = getattr(fn, _REPLAYS, ())
    if any(t is table for t, _ in replays):
        return

    def recompute(*args: Any, **kwargs: Any) -> Any:
        with OpRuleMode(table, device_type):
            return fn(*args, **kwargs)

    setattr(recompute, _REPLAYS, (*replays, (table, device_type)))
    setattr(recompute, _SNAPSHOT, getattr(fn, _SNAPSHOT, None))
    set_recompute_function(target, recompute)


_SNAPSHOT = "_mixprec_snapshot"  # attribute of a wrapper: the forward context it replays


def capture_for_recompute(snapshot: Callable[[], Any]) -> None:
    """Inside a checkpoint's forward (eager), make its recomputation replay the context
    ``snapshot()`` captures now (once per checkpoint: the first module call inside it).
    The snapshot has a ``replaying(args)`` context manager (the recomputation's arguments).

    Example:
        >>> capture_for_recompute(lambda: None)  # outside a checkpoint: nothing to do

    Host sync: none.
    """
    snap = None
    for target in running_checkpoints():  # nested ones: each that nothing captured yet
        if getattr(recompute_function(target), _SNAPSHOT, None) is None:
            snap = snapshot() if snap is None else snap
            _wrap_recompute(target, snap)


def _wrap_recompute(target: CheckpointTarget, snap: Any) -> None:
    fn = recompute_function(target)

    def recompute(*args: Any, **kwargs: Any) -> Any:
        with snap.replaying(args):
            return fn(*args, **kwargs)

    setattr(recompute, _SNAPSHOT, snap)
    setattr(recompute, _REPLAYS, getattr(fn, _REPLAYS, ()))
    set_recompute_function(target, recompute)


# ---------------------------------------------------------------- the op rule mode
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
        >>> from mixprec._src.autocast.ops import apply_op_rule
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


def _traced_under(key: object) -> None:
    """Run by Dynamo at trace time (marked below), which guards on ``key`` by identity."""
    backward_autocast_off_while_tracing()


mark_constant(_traced_under)


class OpRuleMode(TorchFunctionMode):
    """Applies a name -> rule table to torch function calls while native autocast is on.

    Args:
        table: Python op name (``"softmax"``) -> rule.
        device_type: the region's device type.
        key: an object compiled graphs are guarded on by identity (the region's policy).

    Example:
        >>> import torch
        >>> from mixprec import Rule
        >>> from mixprec._src.autocast.ops import OpRuleMode
        >>> mode = OpRuleMode({"mm": Rule("fp32")}, "cpu")
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), mode:
        ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.float32

    Host sync: none.
    """

    def __init__(self, table: Mapping[str, Rule], device_type: str, key: object = None) -> None:
        super().__init__()
        self.table = table
        self.device_type = device_type
        self.key = key  # what compiled graphs depend on: the region's (interned) policy
        # The checkpoint whose forward creates this mode (its recompute creates it again).
        self.home = None if torch.compiler.is_compiling() else current_checkpoint()

    @never_compiled_alone
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            _traced_under(self.key)  # the graph depends on the policy, by identity
        rule = self.table.get(getattr(func, "__name__", ""))
        if rule is None or not torch.is_autocast_enabled(self.device_type):
            return func(*args, **kwargs)
        if not torch.compiler.is_compiling():  # compiled graphs recompute as traced
            target = current_checkpoint()
            if target is not None and (self.home is None or target[0] is not self.home[0]):
                replay_in(target, self.table, self.device_type)
        return apply_op_rule(func, rule, self.device_type, args, kwargs)
