"""The thread's module calls in a region: frames, typed call entries, and the names of modules.

One :class:`Frame` per active region (its device, dtype, policy and what its fp8 rules did), one
:class:`Call` per running module call (pushed by the module pre-hook, popped by the post-hook:
:mod:`.modules`), all in a thread-local :data:`TLS`. Modules are named relative to their root
(:mod:`.tree`) by :func:`locate`.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from mixprec._src import torch_compat
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.tree import Effective, Tree, at, find, has_tree, tree_of
from mixprec._src.fp8 import hook as fp8_hook


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
        grad: grad mode was on when it started.

    Host sync: none.
    """

    __slots__ = (
        "cast",
        "grad",
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


def is_wrapper(module: nn.Module) -> bool:
    """torch.compile's ``OptimizedModule``: its inner module is the one named and bound."""
    return type(module).__name__ == "OptimizedModule" and "_orig_mod" in torch_compat.submodules(
        module
    )


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
