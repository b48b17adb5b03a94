"""Module rules: two process-wide module hooks apply each module's rule to the forward running it.

While a region with module rules or a report is active, a forward pre-hook and an always-called
forward hook (torch's public ``register_module_forward_pre_hook`` and
``register_module_forward_hook``, registered at the first entry, removed at the last exit) run
around every module call. The
pre-hook names the module (:mod:`.tree`), looks up its :class:`~.tree.Effective` rule under the
region's policy, applies it and pushes a :class:`Call` on the thread's stack; the post-hook pops it
and undoes exactly that. Nothing is stored on the user's modules.

**What a rule does.** ``fp32``/``keep``/dtype rules switch the *native* autocast state for the
call; an fp8-family rule opens a :class:`~mixprec._src.fp8.hook.Scope` and keeps the thread's
:class:`~mixprec._src.fp8.hook.Fp8Mode` entered, which serves the matmuls on the module's weights
under the innermost call's scope. A rule inherited from an owner that is running is in force
already (nothing to switch); one whose owner is not running (a container its parent iterates or
indexes, a recomputed child) is applied at the child. Rules act only where native autocast is on
(an ``fp32`` or ``keep`` module is a closed island); fp8-family rules run in a float32 region too.

**Checkpoint recomputation** runs in backward, outside the region. The first module call inside a
checkpoint's forward captures the forward's context (:class:`Snapshot`: the frame, the roots, the
calls around the checkpoint, the stats, the tensors followed) into the checkpoint's recompute
function (:mod:`.replay`), which replays it: the recompute runs under the forward's own rules,
whatever ran in between, in any thread.

**torch.compile.** Dynamo traces these hooks. While tracing, the rule comes from
:func:`_compiled_rule`, which Dynamo runs eagerly at trace time (``assume_constant_result``) and
guards on the identity of its arguments, the module and the region's policy: another policy
recompiles or takes another cached graph; native rules enter a ``torch.autocast`` around each
torch call of the module (:class:`_TracedRegion`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._compile import _disable_dynamo
from torch.fx import GraphModule
from torch.nn.modules import module as nn_module
from torch.overrides import TorchFunctionMode

from mixprec._src.autocast.casting import cast_tree, cast_value, first_floating_dtype
from mixprec._src.autocast.native import backward_autocast_off_while_tracing, never_compiled_alone
from mixprec._src.autocast.ops import capture_for_recompute
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.rules import compute_dtype, output_dtype
from mixprec._src.autocast.tree import Effective, Tree, at, find, has_tree, tree_of
from mixprec._src.fp8 import hook as fp8_hook
from mixprec._src.fp8.recipes import get_recipe
from mixprec._src.fp8.stats import ACTIVE
from mixprec.errors import ConfigError


class Frame:
    """The mixprec part of one active region in one thread. Host sync: none."""

    __slots__ = (
        "calls_len",
        "device_type",
        "dtype",
        "enabled",
        "fp8_on",
        "policy",
        "ran",
        "roots",
        "served",
    )

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype,
        enabled: bool,
        policy: Policy | None,
        fp8_on: bool | None = None,
    ) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self.enabled = enabled
        self.fp8_on = enabled if fp8_on is None else fp8_on  # also in a float32 region
        self.policy = policy
        self.roots: list[nn.Module] = []  # the roots that ran while this frame was innermost
        self.ran: set[object] = set()  # the policy keys of the fp8-family rules that ran
        self.served: set[object] = set()  # those of them that served a matmul
        self.calls_len = 0


class Saved:
    """The native autocast state an eager rule switched (restored when its call ends).

    Host sync: none.
    """

    __slots__ = ("cache", "dtype", "enabled")

    def __init__(self, device_type: str) -> None:
        self.enabled = torch.is_autocast_enabled(device_type)
        self.dtype = torch.get_autocast_dtype(device_type)
        self.cache = torch.is_autocast_cache_enabled()

    def restore(self, device_type: str) -> None:
        """Put the state back. Host sync: none."""
        torch.set_autocast_enabled(device_type, self.enabled)
        torch.set_autocast_dtype(device_type, self.dtype)
        torch.set_autocast_cache_enabled(self.cache)


class Call:
    """One module call running in a region: pushed by the pre-hook, popped by the post-hook.

    Attributes:
        module: the module (held only while it runs).
        name: its qualified name.
        output: the output cast of its rule (applied where ``cast``).
        source: the policy key of its rule (None: no rule).
        island: inside an ``fp32``/``keep`` call (no rule acts there).
        cast: whether this call applies the rule's output cast.
        scope: the fp8 scope this call opened (fp8-family rules).
        saved: the native state an eager rule switched.
        traced: the mode a traced rule entered, and the autocast state it set.
        in_dtype: the dtype of the first floating input (for an ``@input`` output cast).
        holds_mode: this call entered the thread's fp8 mode.
        replayed: a call around a checkpoint, replayed in its recomputation (never closed).

    Host sync: none.
    """

    __slots__ = (
        "cast",
        "holds_mode",
        "in_dtype",
        "island",
        "kind",
        "module",
        "name",
        "output",
        "replayed",
        "saved",
        "scope",
        "source",
        "traced",
    )

    def __init__(self, module: nn.Module | None, name: str, output: Any, source: object) -> None:
        self.module, self.name, self.output, self.source = module, name, output, source
        self.kind = type(module).__name__
        self.island = self.cast = self.holds_mode = self.replayed = False
        self.scope: fp8_hook.Scope | None = None
        self.saved: Saved | None = None
        self.traced: tuple[_TracedRegion | None, tuple[bool, torch.dtype]] | None = None
        self.in_dtype: torch.dtype | None = None

    def replay_copy(self) -> Call:
        """What a recomputation pushes for this call: its rule and scope, nothing to undo.

        Host sync: none.
        """
        copy = Call(None, self.name, None, None)
        copy.island, copy.replayed, copy.kind = self.island, True, self.kind
        if self.scope is not None:
            s = self.scope
            copy.scope = fp8_hook.Scope(s.name, s.recipe, s.hp, s.stats, False, s.model)
        return copy


class _Tls(threading.local):
    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.calls: list[Call] = []  # the module calls running in this thread's regions
        self.roots: list[tuple[nn.Module, Tree]] = []  # the region's roots, newest last
        self.current: tuple[nn.Module, Tree] | None = None  # the root of the last lookup
        self.reporting = 0
        self.mode: fp8_hook.Fp8Mode | None = None  # entered while an fp8 scope is open


TLS = _Tls()


def current_scope() -> fp8_hook.Scope | None:
    """The fp8 scope of the innermost module call (None: its matmuls are not served).

    Example:
        >>> current_scope() is None
        True

    Host sync: none.
    """
    calls = TLS.calls
    return calls[-1].scope if calls else None


def current_module_name() -> str | None:
    """Qualified name of the innermost module running in this thread's region (None outside).

    Example:
        >>> current_module_name() is None
        True

    Host sync: none.
    """
    calls = TLS.calls
    return calls[-1].name if calls and TLS.frames else None


def forget_roots() -> None:
    """Drop this thread's references to the models run in the region (at the outermost exit).

    Example:
        >>> forget_roots(); TLS.roots
        []

    Host sync: none.
    """
    TLS.roots = []
    TLS.current = None


def names_run(frame: Frame) -> list[str]:
    """The qualified names of every module of the roots that ran in ``frame``'s region, sorted.

    Example:
        >>> names_run(Frame("cpu", torch.bfloat16, True, None))
        []

    Host sync: none.
    """
    return sorted({n for root in frame.roots for n, _ in tree_of(root).names.values()})


def _is_wrapper(module: nn.Module) -> bool:
    """torch.compile's ``OptimizedModule``: its inner module is the one named and bound."""
    return type(module).__name__ == "OptimizedModule" and "_orig_mod" in module._modules


def locate(module: nn.Module, frame: Frame) -> tuple[nn.Module, Tree, str]:
    """The root, tree and qualified name of a module that runs in the region.

    Host sync: none.
    """
    tls = TLS
    if tls.current is not None:
        root, tree = tls.current
        entry = tree.names.get(id(module))
        if entry is not None and at(root, entry[1]) is module:
            return root, tree, entry[0]
    for rebuild in (False, True):  # the second pass: modules added to a root since
        for i, (root, tree) in enumerate(tls.roots):
            tree, name = find(root, tree_of(root, fresh=True) if rebuild else tree, module)
            tls.roots[i] = (root, tree)
            if name is not None:
                return _entered(frame, root, tree, name)
        if has_tree(module):
            break  # a root of an earlier region: a root again
    tree = tree_of(module)
    tls.roots.append((module, tree))
    return _entered(frame, module, tree, "")


def _entered(frame: Frame, root: nn.Module, tree: Tree, name: str) -> tuple[nn.Module, Tree, str]:
    TLS.current = (root, tree)
    if not any(r is root for r in frame.roots):
        frame.roots.append(root)
    return root, tree, name


def _owner_running(eff: Effective, name: str) -> bool:
    return eff.owner != name and any(c.name == eff.owner for c in TLS.calls)


# ---------------------------------------------------------------- eager rules
def _open(
    module: nn.Module, name: str, eff: Effective | None, frame: Frame, root: object, args: Any
) -> tuple[Call, Any]:
    """The call of ``module`` with its rule applied; the inputs when the rule cast them."""
    calls = TLS.calls
    call = Call(module, name, None if eff is None else eff.rule.output, eff and eff.source)
    call.island = bool(calls) and calls[-1].island
    if eff is None or not frame.fp8_on:
        return call, None
    rule, dev = eff.rule, frame.device_type
    running = _owner_running(eff, name)
    if rule.fp8_family:
        native_on = torch.is_autocast_enabled(dev) or not frame.enabled
        if not call.island and frame.fp8_on and native_on:
            _open_scope(call, module, eff, frame, root)
            call.cast = not running
            call.in_dtype = first_floating_dtype(args, {})
        return call, None
    if running or not frame.enabled or not torch.is_autocast_enabled(dev):
        call.island = call.island or (running and rule.compute in ("fp32", "keep"))
        return call, None  # in force already, or inside an island
    call.cast, call.in_dtype = True, first_floating_dtype(args, {})
    call.saved = Saved(dev)
    if rule.compute in ("fp32", "keep"):
        call.island = True
        torch.set_autocast_enabled(dev, False)
        return call, cast_tree(args, {}, dev, torch.float32)[0] if rule.compute == "fp32" else None
    target = rule.compute_dtype(frame.dtype)
    if target is not None and target != call.saved.dtype:
        torch.set_autocast_dtype(dev, target)
        torch.set_autocast_cache_enabled(False)  # the cast cache is not keyed by dtype
    return call, None


def _open_scope(call: Call, module: nn.Module, eff: Effective, frame: Frame, root: object) -> None:
    """Open the fp8 scope of ``call`` and follow the module's weights in the thread's mode."""
    assert eff.rule.recipe is not None
    stats = fp8_hook.stats_for_scope()
    hp = frame.dtype if frame.enabled else torch.float32
    recipe = get_recipe(eff.rule.recipe)
    call.scope = fp8_hook.Scope(call.name, recipe, hp, stats, eff.guarded, root)
    frame.ran.add(eff.source)
    weights = [*module.parameters(), *module.buffers()]
    tls = TLS
    if tls.mode is None:
        tls.mode = fp8_hook.Fp8Mode(weights, current_scope)
        tls.mode.__enter__()
        call.holds_mode = True
    else:
        tls.mode.follow(weights)


def _close(call: Call, frame: Frame | None, output: Any, failed: bool) -> Any:
    """Undo what :func:`_open` (or the traced pre-hook) did; the output, cast if the rule says."""
    tls = TLS
    if call.holds_mode and tls.mode is not None:
        tls.mode.__exit__(None, None, None)
        tls.mode = None
    dev = "cpu" if frame is None else frame.device_type
    if call.saved is not None:
        call.saved.restore(dev)
    if call.traced is not None and call.traced[0] is not None:
        call.traced[0].__exit__(None, None, None)
    scope = call.scope
    if scope is not None:
        parent = tls.calls[-1].scope if tls.calls else None
        if parent is not None:
            parent.served += scope.served  # an owner serves what its children served
        if scope.served and frame is not None:
            frame.served.add(call.source)
        if scope.guarded and not scope.served and not failed:
            _raise(fp8_hook.served_nothing(scope, call.kind))
    if not call.cast or output is None or call.output is None or frame is None:
        return None
    out_dtype = output_dtype(call.output, frame.dtype, call.in_dtype)
    return None if out_dtype is None else cast_value(output, dev, out_dtype)


@_disable_dynamo
def _raise(error: ConfigError) -> None:
    raise error  # Dynamo runs this eagerly (a graph break): the user's error


# ---------------------------------------------------------------- global hooks
@never_compiled_alone
def _global_pre(module: nn.Module, args: Any) -> Any:
    tls = TLS
    if not tls.frames or isinstance(module, GraphModule):  # compiler artifacts are not model code
        return None
    frame = tls.frames[-1]
    policy = frame.policy
    if policy is not None and not tls.reporting and not policy._has_module_rules:
        return None  # an inner region's policy without module rules: nothing to bind
    if torch.compiler.is_compiling():
        return None if policy is None else _traced_pre(module, policy, frame, args)
    if _is_wrapper(module):
        return None
    root, tree, name = locate(module, frame)
    eff = None if policy is None else tree.plan(root, policy).rules.get(id(module))
    if policy is not None and policy._has_module_rules:
        capture_for_recompute(lambda: Snapshot(frame))
    call, new_args = _open(module, name, eff, frame, root, args)
    tls.calls.append(call)
    return new_args


@never_compiled_alone
def _global_post(module: nn.Module, args: Any, output: Any) -> Any:
    tls = TLS
    calls = tls.calls
    if not calls or calls[-1].module is not module:
        return None  # our pre-hook did not push this call (an earlier pre-hook raised)
    call = calls.pop()
    frame = tls.frames[-1] if tls.frames else None
    failed = not torch.compiler.is_compiling() and sys.exc_info()[0] is not None
    return _close(call, frame, output, failed)


# ---------------------------------------------------------------- checkpoint recomputation
class Snapshot:
    """The context of a forward around a checkpoint, replayed by its recomputation: the frame,
    the roots, the calls around the checkpoint, the stats entered and the tensors followed.

    Host sync: none.
    """

    __slots__ = ("calls", "followed", "frame", "roots", "stats")

    def __init__(self, frame: Frame) -> None:
        tls = TLS
        self.frame = Frame(frame.device_type, frame.dtype, frame.enabled, frame.policy)
        self.frame.fp8_on = frame.fp8_on
        self.roots = list(tls.roots)
        self.calls = [c.replay_copy() for c in tls.calls]
        self.stats = list(ACTIVE.stack)
        self.followed = None if tls.mode is None else tls.mode.followed

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Run the recomputation in this context (this thread's own state set aside).

        Host sync: none.
        """
        tls = TLS
        saved = (tls.frames, tls.calls, tls.roots, tls.current, tls.mode, ACTIVE.stack)
        tls.frames, tls.calls, tls.roots = [self.frame], list(self.calls), list(self.roots)
        tls.current, tls.mode = None, None
        ACTIVE.stack = [*saved[5], *self.stats]
        acquire_global_hooks()
        if self.followed is not None:  # the calls around the checkpoint serve their matmuls
            tls.mode = fp8_hook.Fp8Mode(self.followed, current_scope)
            tls.mode.__enter__()
        try:
            yield
        finally:
            if self.followed is not None and tls.mode is not None:
                tls.mode.__exit__(None, None, None)
            release_global_hooks()
            tls.frames, tls.calls, tls.roots, tls.current, tls.mode, ACTIVE.stack = saved


# ---------------------------------------------------------------- rules under torch.compile
def _compiled_rule(module: nn.Module, policy: Policy) -> Any:
    """While Dynamo traces: the module's rule as plain values ``(name, owner, compute, output,
    recipe, guarded, fp8_family)``, None (no rule) or an error message. Run eagerly at trace time
    (marked below), so names, trees and checks work as in eager mode; Dynamo guards on
    ``module`` and ``policy`` by identity, which is what makes a compiled graph depend on the
    region's policy."""
    backward_autocast_off_while_tracing()
    frame = TLS.frames[-1]
    try:
        root, tree, name = locate(module, frame)
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
# at `import mixprec`; tests/test_autocast_compile.py checks the decorator still does only this.
_compiled_rule._dynamo_marked_constant = True  # type: ignore[attr-defined]


class _TracedRegion(TorchFunctionMode):
    """While Dynamo traces: every torch call of a module with a rule runs in a native region of
    the rule's settings. A ``with torch.autocast(...)`` is what Dynamo traces everywhere, inside
    checkpoint's subgraphs too; the state switches of the eager hooks are not (there, or at all
    for ``torch.set_autocast_dtype``). The graph keeps only the casts this produces."""

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


@_disable_dynamo
def _refuse_while_tracing(message: str) -> None:
    raise ConfigError(message)  # Dynamo runs this eagerly (a graph break): the user's error


def _traced_pre(module: nn.Module, policy: Policy, frame: Frame, args: Any) -> Any:
    found = _compiled_rule(module, policy)
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
        region = _TracedRegion(dev, target, on)
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


# ---------------------------------------------------------------- global registration
# The two hooks are registered at the first region that needs them and stay registered (outside
# a region they return at once): Dynamo guards on the keys of torch's hook dicts, so fresh handles
# at each region would recompile every compiled model, and re-inserting old handles would mean
# writing torch's private dicts. Regions only count themselves (the count says whether any is
# active; the hooks read the thread's own frames).
_LOCK = threading.Lock()
_GLOBAL: dict[str, Any] = {"count": 0, "handles": None}


def acquire_global_hooks() -> None:
    """Register the process-wide hooks once (torch's public registration), and count a region
    that uses them.

    Example:
        >>> acquire_global_hooks(); release_global_hooks()

    Host sync: none.
    """
    with _LOCK:
        _GLOBAL["count"] += 1
        if _GLOBAL["handles"] is None:
            _GLOBAL["handles"] = (
                nn_module.register_module_forward_pre_hook(_global_pre),
                nn_module.register_module_forward_hook(_global_post, always_call=True),
            )


def release_global_hooks() -> None:
    """Count one region fewer (the hooks stay registered, inert outside regions).

    Example:
        >>> acquire_global_hooks(); release_global_hooks()

    Host sync: none.
    """
    with _LOCK:
        _GLOBAL["count"] -= 1


def detach_hooks(module: nn.Module) -> int:
    """Kept for compatibility: mixprec attaches nothing to modules any more (the rules live in
    the region), so there is nothing to remove; forgets the names kept for ``module``.

    Example:
        >>> from torch import nn
        >>> detach_hooks(nn.Linear(2, 2))
        0

    Returns:
        0: the number of modules that carried mixprec hooks.

    Host sync: none.
    """
    from mixprec._src.autocast.tree import forget_tree

    forget_tree(module)
    return 0
