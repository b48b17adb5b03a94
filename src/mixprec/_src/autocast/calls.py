"""The thread's module calls in a region: frames, typed call entries, and the names of modules.

One :class:`Frame` per active region (its device, dtype, policy and what its fp8 rules did), one
:class:`Call` per running module call (pushed by the module pre-hook, popped by the post-hook:
:mod:`.modules`), all in a thread-local :data:`TLS`. Modules are named relative to their root
(:mod:`.tree`) by :func:`locate`.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch
from torch import nn

from mixprec._src import torch_compat
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.rules import compute_dtype
from mixprec._src.autocast.tree import Effective, Tree, at, find, has_tree, tree_of
from mixprec._src.fp8 import hook as fp8_hook


class Frame:
    """The mixprec part of one active region in one thread. Host sync: none."""

    __slots__ = (
        "calls_len",
        "device_type",
        "dtype",
        "enabled",
        "entered",
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
        self.entered: Any = None  # what its region's exit undoes (region.Entered)


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
        grad: grad mode was on when it started.
        eager: pushed by the eager hook (not while Dynamo traced).
        subtree: for an eager call of a module whose forward runs compiled, the rule of each
            module under it by relative name (:func:`~.traced.subtree_rules`); else None.
        outer_running: with ``subtree``, whether the owner of the module's rule, where it is
            outside the module, is running.

    Host sync: none.
    """

    __slots__ = (
        "cast",
        "eager",
        "grad",
        "holds_mode",
        "in_dtype",
        "island",
        "kind",
        "module",
        "name",
        "outer_running",
        "output",
        "replayed",
        "saved",
        "scope",
        "source",
        "subtree",
        "traced",
    )

    def __init__(self, module: nn.Module | None, name: str, output: Any, source: object) -> None:
        self.module, self.name, self.output, self.source = module, name, output, source
        self.kind = type(module).__name__
        self.island = self.cast = self.holds_mode = self.replayed = False
        self.eager = self.outer_running = False
        self.subtree: dict[str, tuple[Any, ...]] | None = None
        self.grad = True  # grad mode was on at the call (a checkpoint inside may record)
        self.scope: fp8_hook.Scope | None = None
        self.saved: Saved | None = None
        self.traced: tuple[Any, tuple[bool, torch.dtype]] | None = None  # (a mode, the state)
        self.in_dtype: torch.dtype | None = None

    def replay_copy(self) -> Call:
        """What a recomputation pushes for this call: its rule and scope, nothing to undo.

        Host sync: none.
        """
        copy = Call(None, self.name, None, None)
        copy.island, copy.replayed, copy.kind = self.island, True, self.kind
        if self.scope is not None:
            s = self.scope
            copy.scope = fp8_hook.Scope(
                s.name, s.recipe, s.hp, s.stats, False, s.model, label=s.label
            )
        return copy


class _Tls(threading.local):
    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.calls: list[Call] = []  # the module calls running in this thread's regions
        self.roots: list[tuple[nn.Module, Tree]] = []  # the region's roots, newest last
        self.current: tuple[nn.Module, Tree] | None = None  # the root of the last lookup
        self.reporting = 0
        self.mode: fp8_hook.Fp8Mode | None = None  # entered while an fp8 scope is open
        self.compiled_next: nn.Module | None = None  # torch.compile(module) wraps: it compiles


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
    return sorted({n for root in frame.roots for n in tree_of(root).every})


def is_wrapper(module: nn.Module) -> bool:
    """torch.compile's ``OptimizedModule``: its inner module is the one named and bound."""
    return torch_compat.is_compiled_module(module)


def locate(module: nn.Module, frame: Frame) -> tuple[nn.Module, Tree, str] | None:
    """The root, tree and qualified name of a module that runs in the region; None for a
    container made on the fly from modules of a known tree (``self.layers[1:]``, a slice of an
    ``nn.Sequential``): it has no name of its own, its modules keep theirs.

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
        if not rebuild and _holds_known(module):
            return None
    tree = tree_of(module)
    tls.roots.append((module, tree))
    return _entered(frame, module, tree, "")


def _holds_known(module: nn.Module) -> bool:
    """Whether a child of ``module`` is a module of a root's tree (``module`` is not)."""
    trees = [tree for _, tree in TLS.roots]
    return any(id(c) in tree.names for c in module.children() for tree in trees)


def _entered(frame: Frame, root: nn.Module, tree: Tree, name: str) -> tuple[nn.Module, Tree, str]:
    TLS.current = (root, tree)
    if not any(r is root for r in frame.roots):
        frame.roots.append(root)
    return root, tree, name


def owner_running(eff: Effective, name: str) -> bool:
    return eff.owner != name and any(c.name == eff.owner for c in TLS.calls)


# ---------------------------------------------------------------- the rule decision
class Decision(NamedTuple):
    """What a module call does with its rule (:func:`decide`), applied by the eager hook as
    native state switches and by the traced hook as traced regions.

    Attributes:
        scope: open an fp8 scope (an fp8-family rule that acts here).
        cast: apply the rule's output cast at the end of the call (the input dtype is recorded).
        island: the call is inside an ``fp32``/``keep`` island.
        native: the native autocast state ``(enabled, dtype)`` the call switches to; None where
            it switches nothing (fp8-family rules, rules in force already, a dtype in force).
        fp32_inputs: cast the floating inputs to float32 (an ``fp32`` rule).

    Host sync: none.
    """

    scope: bool
    cast: bool
    island: bool
    native: tuple[bool, torch.dtype] | None
    fp32_inputs: bool


def decide(
    compute: str | torch.dtype,
    family: bool,
    running: bool,
    island: bool,
    frame: Frame,
    state: tuple[bool, torch.dtype],
) -> Decision:
    """The one rule decision of a module call, eager or traced: its rule's ``compute`` (an
    fp8-family rule where ``family``), whether the rule's owner is ``running`` (the rule is in
    force already), whether the call is inside an ``island``, the region's ``frame`` and the
    native autocast ``state`` ``(enabled, dtype)`` around the call.

    Rules act only where native autocast is on (an ``fp32``/``keep`` module is a closed island);
    fp8-family rules run in a float32 region too.

    Example:
        >>> frame = Frame("cpu", torch.bfloat16, True, None)
        >>> decide("fp32", False, False, False, frame, (True, torch.bfloat16)).native
        (False, torch.bfloat16)

    Host sync: none.
    """
    enabled, low = state
    if family:
        scope = not island and frame.fp8_on and (enabled or not frame.enabled)
        return Decision(scope, scope and not running, island, None, False)
    if running or not frame.enabled or not enabled:
        return Decision(
            False, False, island or (running and compute in ("fp32", "keep")), None, False
        )
    if compute in ("fp32", "keep"):
        return Decision(False, True, True, (False, low), compute == "fp32")
    target = compute_dtype(compute, frame.dtype)
    native = None if target is None or target == low else (True, target)
    return Decision(False, True, island, native, False)


def region_policy() -> tuple[bool, Policy | None]:
    """Whether this thread is inside an enabled mixprec region, and the policy in force there
    (a region without one inherits the enclosing region's): what the advisor's Watch compares
    with the advice it watches.

    Example:
        >>> region_policy()
        (False, None)

    Host sync: none.
    """
    frame = TLS.frames[-1] if TLS.frames else None
    if frame is None or not frame.enabled:
        return False, None
    return True, frame.policy


def outermost_call() -> Call | None:
    """The outermost module call running in this thread's region (None outside one, or where
    the region binds no module rule): a new object for each forward, what tells one forward of
    a model from the next (the FSDP2 low-precision gather exchanges its scales once per forward).

    Example:
        >>> outermost_call() is None
        True

    Host sync: none.
    """
    calls = TLS.calls
    return calls[0] if calls else None
