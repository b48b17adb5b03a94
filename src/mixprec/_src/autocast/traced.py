"""Module rules while Dynamo traces: the rule as plain values, native rules as traced regions.

Dynamo inlines the module hooks (:mod:`.modules`) into the code it traces, where they take this
path: the rule comes from :func:`compiled_rule`, which Dynamo runs eagerly at trace time
(``assume_constant_result``) and guards on the identity of its arguments, the module and the
region's policy (another policy recompiles or takes another cached graph); an ``fp32``/``keep`` or
dtype rule enters a ``torch.autocast`` around each torch call of the module
(:class:`TracedRegion`); an fp8-family rule opens its scope as in eager mode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec._src.autocast.calls import TLS, Call, Frame, current_scope, locate
from mixprec._src.autocast.casting import cast_tree, first_floating_dtype
from mixprec._src.autocast.native import backward_autocast_off_while_tracing, never_compiled_alone
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.rules import compute_dtype
from mixprec._src.fp8 import hook as fp8_hook
from mixprec._src.fp8.recipes import get_recipe
from mixprec._src.torch_compat import disable_dynamo, mark_constant
from mixprec.errors import ConfigError


def compiled_rule(module: nn.Module, policy: Policy) -> Any:
    """While Dynamo traces: the module's rule as plain values ``(name, owner, compute, output,
    recipe, guarded, fp8_family)``, None (no rule) or an error message. Run eagerly at trace time
    (marked below), so names, trees and checks work as in eager mode; Dynamo guards on
    ``module`` and ``policy`` by identity, which is what makes a compiled graph depend on the
    region's policy."""
    backward_autocast_off_while_tracing()
    frame = TLS.frames[-1]
    try:
        found = locate(module, frame)
        if found is None:
            return None  # a slice of a container: its modules are named
        root, tree, name = found
        eff = tree.plan(root, policy).rules.get(id(module))
        if eff is None:
            return None
        if eff.rule.fp8_family:  # traced: the guard of each forward says whether it served
            frame.ran.add(eff.source)
            frame.served.add(eff.source)
    except ConfigError as error:  # raised eagerly below, not as an error of Dynamo's
        return str(error)
    rule = eff.rule
    return name, eff.owner, rule.compute, rule.output, rule.recipe, eff.guarded, rule.fp8_family


# What torch.compiler.assume_constant_result does, without importing torch._dynamo (and sympy)
# at `import mixprec`; tests/autocast/test_autocast_compile.py checks the decorator still does
# only this.
mark_constant(compiled_rule)


class TracedRegion(TorchFunctionMode):
    """While Dynamo traces: every torch call of a module with a rule runs in a native region of
    the rule's settings. A ``with torch.autocast(...)`` is what Dynamo traces everywhere, inside
    checkpoint's subgraphs too; the state switches of the eager hooks are not (there, or at all
    for ``torch.set_autocast_dtype``). The graph keeps only the casts this produces.

    Example:
        >>> with TracedRegion("cpu", torch.bfloat16, True):
        ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.bfloat16

    Host sync: none.
    """

    def __init__(self, device_type: str, dtype: torch.dtype, enabled: bool) -> None:
        super().__init__()
        self.device_type, self.dtype, self.enabled = device_type, dtype, enabled

    @never_compiled_alone
    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        dev, dtype, on = self.device_type, self.dtype, self.enabled
        with torch.autocast(dev, dtype=dtype, enabled=on, cache_enabled=False):
            return func(*args, **(kwargs or {}))


def _traced_state(device_type: str) -> tuple[bool, torch.dtype]:
    """The autocast state the innermost traced rule set (the native state outside any)."""
    for call in reversed(TLS.calls):
        if call.traced is not None:
            return call.traced[1]
        if call.saved is not None:
            break  # an eager rule (a graph break inside its module): it set the native state
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


@disable_dynamo
def _refuse_while_tracing(message: str) -> None:
    raise ConfigError(message)  # Dynamo runs this eagerly (a graph break): the user's error


def traced_pre(module: nn.Module, policy: Policy, frame: Frame, args: Any) -> Any:
    found = compiled_rule(module, policy)
    if isinstance(found, str):
        _refuse_while_tracing(found)
    if found is None:
        return None
    name, owner, compute, output, recipe, guarded, family = found
    calls = TLS.calls
    call = Call(module, name, output, None)
    call.island = bool(calls) and calls[-1].island
    running = owner != name and any(c.name == owner for c in calls)
    dev = frame.device_type
    enabled, low = _traced_state(dev)
    if family:
        if not call.island and frame.fp8_on and (enabled or not frame.enabled):
            _traced_scope(call, module, recipe, guarded, frame)
            call.cast, call.in_dtype = not running, first_floating_dtype(args, {})
        calls.append(call)
        return None
    if running or not frame.enabled or not enabled:
        call.island = call.island or (running and compute in ("fp32", "keep"))
        calls.append(call)
        return None
    call.cast, call.in_dtype = True, first_floating_dtype(args, {})
    on = compute not in ("fp32", "keep")
    call.island = not on
    target = compute_dtype(compute, frame.dtype) if on else low
    if compute == "fp32":
        args = cast_tree(args, {}, dev, torch.float32)[0]
    region = None
    if target is not None and (not on or target != low):
        region = TracedRegion(dev, target, on)
        region.__enter__()
    call.traced = (region, (on, target if target is not None else low))
    calls.append(call)
    return args


def _traced_scope(call: Call, module: nn.Module, recipe: str, guarded: bool, frame: Frame) -> None:
    hp = frame.dtype if frame.enabled else torch.float32
    fp8_hook.stats_for_scope()  # refuses an entered Fp8Stats
    call.scope = fp8_hook.Scope(call.name, get_recipe(recipe), hp, None, guarded)
    weights = [*module.parameters(), *module.buffers()]
    tls = TLS
    if tls.mode is None:
        tls.mode = fp8_hook.Fp8Mode(weights, current_scope)
        tls.mode.__enter__()
        call.holds_mode = True
    else:
        tls.mode.follow(weights)
