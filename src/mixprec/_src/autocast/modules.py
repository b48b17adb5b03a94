"""Module rules: two process-wide module hooks apply each module's rule to the forward running it.

While a region with module rules or a report runs (in any thread), or a checkpoint recomputes
such a region's forward, a forward pre-hook and an always-called forward hook run around every
module call: added to torch at the first of them, removed at the last
(:func:`acquire_global_hooks`, :func:`release_global_hooks`), so that outside regions torch runs
as without mixprec. The pre-hook names the module (:mod:`.tree`), looks up its
:class:`~.tree.Effective` rule under the region's policy, decides what it does
(:func:`~.calls.decide`), applies it and pushes a :class:`Call` on the thread's stack; the
post-hook pops it and undoes exactly that. Nothing is stored on the user's modules.

**What a rule does.** ``fp32``/``keep``/dtype rules switch the *native* autocast state for the
call; an fp8-family rule opens a :class:`~mixprec._src.fp8.hook.Scope` and keeps the thread's
:class:`~mixprec._src.fp8.hook.Fp8Mode` entered, which serves the matmuls on the module's weights
under the innermost call's scope. A rule inherited from an owner that is running is in force
already (nothing to switch); one whose owner is not running (a container its parent iterates or
indexes, a recomputed child) is applied at the child.

**Checkpoint recomputation** runs in backward, outside the region. The first module call inside a
checkpoint's forward captures the forward's context (:class:`ForwardContext`: the frame, the
roots, the calls around the checkpoint, the stats, the tensors followed) into the recompute
function (:func:`~.ops.capture_for_recompute`), which replays it (:meth:`ForwardContext.replaying`):
the recompute runs under the forward's own rules, whatever ran in between, in any thread.

**torch.compile.** Dynamo traces these hooks; while it does, they take the path of
:mod:`.traced`. The thread's frames and calls live in :mod:`.calls`.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from mixprec._src import torch_compat
from mixprec._src.autocast.calls import (
    TLS,
    Call,
    Frame,
    Saved,
    current_module_name,
    current_scope,
    decide,
    forget_roots,
    is_wrapper,
    locate,
    names_run,
    owner_running,
)
from mixprec._src.autocast.casting import cast_tree, cast_value, first_floating_dtype
from mixprec._src.autocast.native import never_compiled_alone
from mixprec._src.autocast.ops import capture_for_recompute
from mixprec._src.autocast.rules import output_dtype
from mixprec._src.autocast.traced import subtree_rules, traced_pre
from mixprec._src.autocast.tree import Effective
from mixprec._src.fp8 import hook as fp8_hook
from mixprec._src.fp8.recipes import get_recipe
from mixprec._src.fp8.stats import ACTIVE
from mixprec._src.torch_compat import GlobalModuleHooks, disable_dynamo
from mixprec.errors import ConfigError

__all__ = [
    "TLS",
    "Call",
    "ForwardContext",
    "Frame",
    "acquire_global_hooks",
    "current_module_name",
    "forget_roots",
    "names_run",
    "release_global_hooks",
]


# ---------------------------------------------------------------- eager rules
def _open(
    module: nn.Module, name: str, eff: Effective | None, frame: Frame, root: object, args: Any
) -> tuple[Call, Any]:
    """The call of ``module`` with its rule applied (:func:`~.calls.decide`, as native state
    switches); the inputs when the rule cast them."""
    calls = TLS.calls
    call = Call(module, name, None if eff is None else eff.rule.output, eff and eff.source)
    call.island = bool(calls) and calls[-1].island
    if eff is None or not frame.fp8_on:
        return call, None
    rule, dev = eff.rule, frame.device_type
    state = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
    found = decide(
        rule.compute, rule.fp8_family, owner_running(eff, name), call.island, frame, state
    )
    call.island, call.cast = found.island, found.cast
    if found.scope or found.cast:
        call.in_dtype = first_floating_dtype(args, {})
    if found.scope:
        _open_scope(call, module, eff, frame, root)
    if not found.cast or rule.fp8_family:
        return call, None
    call.saved = Saved(dev)
    if found.native is not None and not found.native[0]:
        torch.set_autocast_enabled(dev, False)
    elif found.native is not None:
        torch.set_autocast_dtype(dev, found.native[1])
        torch.set_autocast_cache_enabled(False)  # the cast cache is not keyed by dtype
    return call, cast_tree(args, {}, dev, torch.float32)[0] if found.fp32_inputs else None


def _open_scope(call: Call, module: nn.Module, eff: Effective, frame: Frame, root: object) -> None:
    """Open the fp8 scope of ``call`` and follow the module's weights in the thread's mode."""
    assert eff.rule.recipe is not None
    stats = fp8_hook.stats_for_scope()
    hp = frame.dtype if frame.enabled else torch.float32
    recipe = get_recipe(eff.rule.recipe)
    call.scope = fp8_hook.Scope(call.name, recipe, hp, stats, eff.guarded, root, module)
    frame.ran.add(eff.source)
    weights = [*module.parameters(), *module.buffers()]
    tls = TLS
    if tls.mode is None:
        tls.mode = fp8_hook.Fp8Mode(weights, current_scope, _capture_at_serve)
        tls.mode.__enter__()
        call.holds_mode = True
    else:
        tls.mode.follow(weights)


def _capture_at_serve() -> None:
    """After a served matmul: inside a checkpoint's forward that no module call inside captured
    (a checkpointed function in a module's forward), make its recomputation replay this
    forward's context, as a module call there does. Not while Dynamo traces (a compiled block
    under a rule opened by an eager call around it): a traced forward captures nothing here,
    as the traced path's own mode does (checkpoint's frames cannot be traced)."""
    if torch.compiler.is_compiling():
        return
    tls = TLS
    calls = tls.calls
    if tls.frames and (torch.is_grad_enabled() or (calls and calls[-1].grad)):
        frame = tls.frames[-1]
        capture_for_recompute(lambda: ForwardContext(frame))


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
        # (while Dynamo traces, compiled_rule counted it at trace time: a write here would be
        # traced, and guarded on, as the length of this region's set: a recompile per region)
        if scope.served and frame is not None and not torch.compiler.is_compiling():
            frame.served.add(call.source)
        if scope.guarded and not scope.served and not failed:
            _raise(fp8_hook.served_nothing(scope, call.kind))
    if not call.cast or output is None or call.output is None or frame is None:
        return None
    out_dtype = output_dtype(call.output, frame.dtype, call.in_dtype)
    return None if out_dtype is None else cast_value(output, dev, out_dtype)


@disable_dynamo
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
        return None if policy is None else traced_pre(module, policy, frame, args)
    if is_wrapper(module):
        inner = torch_compat.submodules(module)[torch_compat.COMPILED_INNER]
        tls.compiled_next = inner  # its forward compiles
        return None
    compiled = tls.compiled_next is module or torch_compat.compiled_in_place(module)
    tls.compiled_next = None
    found = locate(module, frame)
    if found is None:  # a slice of a container: transparent, its modules are named
        call = Call(module, tls.calls[-1].name if tls.calls else "", None, None)
        call.island = bool(tls.calls) and tls.calls[-1].island
        call.eager = True
        tls.calls.append(call)
        return None
    root, tree, name = found
    eff = None if policy is None else tree.plan(root, policy).rules.get(id(module))
    grad = torch.is_grad_enabled()
    if (
        policy is not None
        and policy._has_module_rules
        and (grad or not tls.calls or tls.calls[-1].grad)
    ):
        # (under a call that began without grad, any checkpoint here began before it: captured)
        capture_for_recompute(lambda: ForwardContext(frame))
    call, new_args = _open(module, name, eff, frame, root, args)
    call.grad, call.eager = grad, True
    if compiled and policy is not None:  # its forward is traced: the rules under it, by path
        call.subtree = subtree_rules(root, tree.plan(root, policy), module, name)
        call.outer_running = eff is not None and owner_running(eff, name)
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
class ForwardContext:
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
    def replaying(self, args: tuple[Any, ...] = ()) -> Iterator[None]:
        """Run the recomputation of a checkpoint called with ``args`` in this context (this
        thread's own state set aside); an argument that is a followed weight detached (reentrant
        checkpointing detaches them) is followed too.

        Host sync: none.
        """
        tls = TLS
        saved = (tls.frames, tls.calls, tls.roots, tls.current, tls.mode, ACTIVE.stack)
        tls.frames, tls.calls, tls.roots = [self.frame], list(self.calls), list(self.roots)
        tls.current, tls.mode = None, None
        ACTIVE.stack = [*saved[5], *self.stats]
        acquire_global_hooks()
        try:
            if self.followed is not None:  # the calls around the checkpoint serve their matmuls
                tls.mode = fp8_hook.Fp8Mode(self.followed, current_scope, _capture_at_serve)
                tls.mode.follow_aliases(args)
                tls.mode.__enter__()
            yield
        finally:
            try:
                if self.followed is not None and tls.mode is not None:
                    tls.mode.__exit__(None, None, None)
            finally:
                tls.frames, tls.calls, tls.roots, tls.current, tls.mode, ACTIVE.stack = saved
                release_global_hooks()


# ---------------------------------------------------------------- global registration
# The two hooks are in torch's global hook dicts only while some region (in any thread) or some
# checkpoint recomputation needs them: added at the first acquire, removed at the last release,
# so that outside regions every forward in the process runs as it would without mixprec and
# torch.compile sees no global hook. They are re-added under the keys of their first
# registration (GlobalModuleHooks says why).
_LOCK = threading.Lock()
_HOOKS = GlobalModuleHooks(_global_pre, _global_post)
_USERS = [0]  # how many acquires are not released yet (all threads)


def acquire_global_hooks() -> None:
    """Add the process-wide hooks unless they are in already; pair with
    :func:`release_global_hooks`.

    Example:
        >>> acquire_global_hooks(); release_global_hooks()

    Host sync: none.
    """
    with _LOCK:
        if _USERS[0] == 0:
            _HOOKS.add()
        _USERS[0] += 1


def release_global_hooks() -> None:
    """Undo one :func:`acquire_global_hooks`; the last one removes the hooks.

    Host sync: none.
    """
    with _LOCK:
        assert _USERS[0] > 0, "release_global_hooks without an acquire"
        _USERS[0] -= 1
        if _USERS[0] == 0:
            _HOOKS.remove()
