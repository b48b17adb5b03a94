"""Module rules while Dynamo traces: the rule as plain values, native rules as traced regions.

Dynamo inlines the module hooks (:mod:`.modules`) into the code it traces, where they take this
path. The rule of a module under a module compiled by itself (per-block compile) is read from
that module's eager call by the module's relative name (:func:`subtree_rules`), and Dynamo
guards the rule's values: blocks with equal rules share one graph. Elsewhere it comes from
:func:`compiled_rule`, which Dynamo runs eagerly at trace time (``assume_constant_result``) and
guards on the identity of its arguments, the module and the region's policy. Either way the
decision is :func:`~.calls.decide`'s: an ``fp32``/``keep`` or dtype rule enters a
``torch.autocast`` around each torch call of the module (:class:`TracedRegion`), an fp8-family
rule opens its scope as in eager mode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec._src.autocast.calls import TLS, Call, Frame, current_scope, decide, locate
from mixprec._src.autocast.casting import cast_tree, first_floating_dtype
from mixprec._src.autocast.native import backward_autocast_off_while_tracing, never_compiled_alone
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.tree import RulePlan
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


# ---------------------------------------------------------------- the rule of a traced module
# A module compiled by itself (torchtitan's `block.compile(fullgraph=True)` for each block, or
# `torch.compile(block)`) runs its own hooks eagerly and its forward compiled: its eager call
# carries the rules of the modules under it by relative name (subtree_rules), and the traced
# hooks of those modules read their rule there by the path from it. Dynamo guards what is read,
# the rule values, so blocks with equal rules share one graph and a block with other rules gets
# its own. (The path is found by identity, which Dynamo does not guard: it holds because the
# compiled frame runs the forward of the module whose eager call is the nearest, by the same
# code, so the same path leads to the module it calls.) Elsewhere (a model compiled whole, a
# compiled function) the rule is looked up by the module's identity (compiled_rule), on which
# Dynamo guards: one graph per model and policy.
_SUBTREES: dict[tuple[int, int], tuple[object, dict[str, tuple[Any, ...]]]] = {}
_SUBTREES_KEPT = 4096


def subtree_rules(
    root: nn.Module, plan: RulePlan, module: nn.Module, name: str
) -> dict[str, tuple[Any, ...]]:
    """The rule of each module under ``module`` (named ``name`` in ``root``) by its name relative
    to ``module``: ``(owner, compute, output, recipe, guarded, fp8_family, source)``, ``owner``
    the owner's relative name, or None where the owner is outside ``module``. Made once per plan
    and module.

    Host sync: none.
    """
    key = (id(plan), id(module))
    found = _SUBTREES.get(key)
    if found is not None and found[0] is plan:
        return found[1]
    prefix = f"{name}." if name else ""
    rules: dict[str, tuple[Any, ...]] = {}
    for rel, mod in module.named_modules(remove_duplicate=False):
        eff = plan.rules.get(id(mod))
        if eff is None:
            continue
        inside = eff.owner == name or eff.owner.startswith(prefix)
        owner = (eff.owner[len(prefix) :] if name else eff.owner) if inside else None
        rule = eff.rule
        rules[rel] = (owner, rule.compute, rule.output, rule.recipe, eff.guarded,
                      rule.fp8_family, eff.source)  # fmt: skip
    while len(_SUBTREES) >= _SUBTREES_KEPT:
        _SUBTREES.pop(next(iter(_SUBTREES)), None)
    _SUBTREES[key] = (plan, rules)
    return rules


def _anchored(module: nn.Module) -> tuple[str, bool, tuple[Any, ...] | None] | None:
    """The module's relative name, whether its rule's owner runs, and its rule, from the nearest
    eager call where that call's forward runs compiled (None: look it up by identity)."""
    calls = TLS.calls
    at = len(calls) - 1
    while at >= 0 and not calls[at].eager:
        at -= 1
    if at < 0:
        return None
    anchor = calls[at]
    subtree, top = anchor.subtree, anchor.module
    if subtree is None or top is None:
        return None
    path = None
    for rel, mod in top.named_modules(remove_duplicate=False):
        if mod is module:
            path = rel
    if path is None:
        return None
    rule = subtree.get(path)
    if rule is None:
        return path, False, None
    owner = rule[0]
    if owner is None:
        return path, anchor.outer_running, rule
    running = owner != path and (owner == "" or any(c.name == owner for c in calls[at + 1 :]))
    return path, running, rule


@mark_constant
def _note_traced(source: object) -> None:
    """At trace time: an fp8-family rule ran and (the guard of each forward says whether it did)
    served, for the region's check at exit."""
    frame = TLS.frames[-1]
    frame.ran.add(source)
    frame.served.add(source)


def _traced_rule(module: nn.Module, policy: Policy) -> Any:
    """``(name, running, rule)`` of a module while Dynamo traces (None: no rule)."""
    backward_autocast_off_while_tracing()
    anchored = _anchored(module)
    if anchored is not None:
        if anchored[2] is not None and anchored[2][5]:
            _note_traced(anchored[2][6])
        return anchored if anchored[2] is not None else None
    found = compiled_rule(module, policy)
    if isinstance(found, str):
        _refuse_while_tracing(found)
    if found is None:
        return None
    name, owner, *rule = found
    running = owner != name and any(c.name == owner for c in TLS.calls)
    return name, running, (owner, *rule, None)  # (compiled_rule noted an fp8 rule's source)


def traced_pre(module: nn.Module, policy: Policy, frame: Frame, args: Any) -> Any:
    """The traced module pre-hook: the rule's :func:`~.calls.decide` as traced regions."""
    found = _traced_rule(module, policy)
    if found is None:
        return None
    name, running, (_, compute, output, recipe, guarded, family, _) = found
    calls = TLS.calls
    call = Call(module, name, output, None)
    dev = frame.device_type
    state = _traced_state(dev)
    island = bool(calls) and calls[-1].island
    decision = decide(compute, family, running, island, frame, state)
    call.island, call.cast = decision.island, decision.cast
    if decision.scope or decision.cast:
        call.in_dtype = first_floating_dtype(args, {})
    if decision.scope:
        _traced_scope(call, module, recipe, guarded, frame)
    if decision.cast and not family:
        region = None
        if decision.native is not None:
            region = TracedRegion(dev, decision.native[1], decision.native[0])
            region.__enter__()
        call.traced = (region, decision.native or state)
    calls.append(call)
    if decision.fp32_inputs:
        return cast_tree(args, {}, dev, torch.float32)[0]
    return None


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
