"""Module rules: global hooks for discovery and names, persistent per-module hooks for the rules.

While a region with module rules or a report is active, two process-wide module hooks (registered
on entry, removed at the last exit) keep a thread-local stack of qualified module names and bind
each module that runs to its rule. A module with a rule gets a pair of per-instance hooks once;
they apply the rule by switching the *native* autocast state, which is what makes rules survive
``torch.utils.checkpoint`` recomputation: recompute runs in backward, outside the region, with the
native state restored by checkpoint, and the per-module hooks replay the rule bound at the
module's latest forward. (Op rules replay through the checkpoint itself: :mod:`.ops`.) A rule of
the fp8 family enters and leaves through :mod:`.fp8` instead of switching the native state.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.nn.modules import module as nn_module

from mixprec._src.autocast import fp8
from mixprec._src.autocast.casting import cast_tree, cast_value, first_floating_dtype
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.rules import Rule


class Frame:
    """The mixprec part of one active region in one thread. Host sync: none."""

    __slots__ = ("device_type", "dtype", "enabled", "names_seen", "policy", "stack_len")

    def __init__(
        self, device_type: str, dtype: torch.dtype, enabled: bool, policy: Policy | None
    ) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self.enabled = enabled
        self.policy = policy
        self.names_seen: set[str] = set()
        self.stack_len = 0


class _Tls(threading.local):
    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.stack: list[str] = []
        self.applied: list[tuple[Any, ...]] = []  # (module id, what its pre-hook did)
        self.root_map: dict[int, str] = {}
        self.root: nn.Module | None = None
        self.roots: list[tuple[nn.Module, dict[int, str]]] = []
        self.reporting = 0


TLS = _Tls()


def current_module_name() -> str | None:
    """Qualified name of the innermost module running in this thread's region (None outside).

    Example:
        >>> current_module_name() is None
        True

    Host sync: none.
    """
    return TLS.stack[-1] if TLS.stack else None


# ---------------------------------------------------------------- names
# Per-module state lives in instance attributes (not weak dictionaries, which Dynamo cannot trace).
_NAMES_ATTR = "_mixprec_names"
_REC_ATTR = "_mixprec_rule"
_PREPARED_ATTR = "_mixprec_prepared"
_NORULE_ATTR = "_mixprec_norule"


def _unwrap(module: nn.Module) -> nn.Module:
    inner = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
    return inner if isinstance(inner, nn.Module) else module


_MAPS_BUILT = [0]  # how many name maps were built: a new one may mean the modules changed


def _build_map(root: nn.Module) -> dict[int, str]:
    _MAPS_BUILT[0] += 1
    mapping = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    object.__setattr__(root, _NAMES_ATTR, mapping)
    return mapping


def _name_of(module: nn.Module) -> str:
    """Qualified name relative to the root module it belongs to; an unknown module is a new root.

    Roots are the modules called at the top of the region (usually the model, maybe a loss
    module); a submodule called directly keeps its name within its root.
    """
    tls = TLS
    name = tls.root_map.get(id(module))
    if name is not None:
        return name
    for root, mapping in tls.roots:
        name = mapping.get(id(module))
        if name is not None:
            tls.root, tls.root_map = root, mapping
            return name
    new_root = _unwrap(module)
    cached: dict[int, str] | None = new_root.__dict__.get(_NAMES_ATTR)
    if cached is None:
        for i, (root, _) in enumerate(tls.roots):  # added to a model since its map was built?
            fresh = _build_map(root)
            tls.roots[i] = (root, fresh)
            if id(module) in fresh:
                tls.root, tls.root_map = root, fresh
                return fresh[id(module)]
        cached = _build_map(new_root)
    tls.roots.append((new_root, cached))
    tls.root, tls.root_map = new_root, cached
    return ""


# ---------------------------------------------------------------- per-module records
class _Record:
    def __init__(self) -> None:
        self.policy: Policy | None = None
        self.name: str | None = None
        self.rule: Rule | None = None
        self.device_type = "cpu"
        self.low = torch.float16
        self.live = False
        self.handles: list[Any] = []
        self.fp8: Any = None  # what fp8.enter_rule keeps between calls (its served modules)


def _record(module: nn.Module) -> _Record | None:
    return module.__dict__.get(_REC_ATTR)


def _needs_hooks(module: nn.Module, policy: Policy, name: str) -> Rule | None:
    """The module rule of a module without hooks (negative answers are cached on the module)."""
    known = module.__dict__.get(_NORULE_ATTR)
    if known is not None and known[0] is policy and known[1] == name:
        return None
    rule = policy.module_rule(module, name)
    if rule is None:
        object.__setattr__(module, _NORULE_ATTR, (policy, name))
    return rule


def _bind(frame: Frame, module: nn.Module, name: str) -> bool:
    """Bind ``module`` to the frame's policy; True when its rule hooks were attached just now.

    Hooks go on modules with a module rule only; the others stay hook-free.
    """
    policy = frame.policy
    assert policy is not None
    rec = _record(module)
    fresh = False
    if rec is None:
        rule = _needs_hooks(module, policy, name)
        if rule is None:
            return False
        rec, fresh = _attach(module), True
        rec.policy, rec.name, rec.rule = policy, name, rule
    elif rec.policy is not policy or rec.name != name:
        rec.policy, rec.name, rec.rule = policy, name, policy.module_rule(module, name)
        rec.fp8 = None
    rec.device_type, rec.low, rec.live = frame.device_type, frame.dtype, frame.enabled
    return fresh


def _prepare_tree(root: nn.Module, policy: Policy, include_root: bool = False) -> None:
    """Attach rule hooks to the root's submodules before they run (their hook lists are read
    when their call starts, so hooks attached during the call would run only half)."""
    if include_root and _record(root) is None and policy.module_rule(root, "") is not None:
        _attach(root)  # called through a torch.compile wrapper, before its own call starts
    if root.__dict__.get(_PREPARED_ATTR) is policy:
        return
    for name, mod in root.named_modules():
        if name and _record(mod) is None and policy.module_rule(mod, name) is not None:
            _attach(mod)
    fp8.check_reach(root, policy)
    object.__setattr__(root, _PREPARED_ATTR, policy)


def _attach(module: nn.Module) -> _Record:
    rec = _Record()
    rec.handles = [
        module.register_forward_pre_hook(_instance_pre, with_kwargs=True),
        module.register_forward_hook(_instance_post, with_kwargs=True, always_call=True),
    ]
    object.__setattr__(module, _REC_ATTR, rec)
    return rec


def detach_hooks(module: nn.Module) -> int:
    """Remove the per-module rule hooks mixprec attached to ``module`` and its children.

    Example:
        >>> from torch import nn
        >>> detach_hooks(nn.Linear(2, 2))
        0

    Returns:
        The number of modules whose hooks were removed.

    Host sync: none.
    """
    count = 0
    for mod in module.modules():
        rec = mod.__dict__.pop(_REC_ATTR, None)
        mod.__dict__.pop(_PREPARED_ATTR, None)
        mod.__dict__.pop(_NAMES_ATTR, None)
        mod.__dict__.pop(_NORULE_ATTR, None)
        if rec is not None:
            for handle in rec.handles:
                handle.remove()
            count += 1
    return count


# ---------------------------------------------------------------- hooks
def _global_pre(module: nn.Module, args: Any) -> Any:
    tls = TLS
    if not tls.frames or isinstance(module, GraphModule):  # compiler artifacts are not model code
        return None
    frame = tls.frames[-1]
    policy = frame.policy
    if policy is not None and not tls.reporting and not policy._has_module_rules:
        return None  # an inner region's policy without module rules: nothing to bind
    name = _name_of(module)
    if tls.reporting:
        tls.stack.append(name)
    if policy is None:
        return None
    frame.names_seen.add(name)
    if not name:
        wrapper = tls.root is not module  # a torch.compile wrapper around the root
        if tls.root is not None:
            _prepare_tree(tls.root, policy, include_root=wrapper)
        if wrapper:
            return None  # its inner module was bound just now, before the compiled frame runs
    if _bind(frame, module, name):
        # First call of a module outside the prepared tree (typically the root): its own pre-hook
        # list was read before we attached, so apply the rule here (positional inputs only); its
        # post-hook list is read after forward, so the instance post-hook will restore.
        result = _instance_pre(module, args, {})
        return None if result is None else result[0]
    return None


def _global_post(module: nn.Module, args: Any, output: Any) -> None:
    tls = TLS  # registered only while a report records module names
    if isinstance(module, GraphModule):
        return
    if tls.frames and len(tls.stack) > tls.frames[-1].stack_len:
        tls.stack.pop()


def _rule_active(rec: _Record) -> bool:
    frames = TLS.frames
    if frames:
        return rec.live and frames[-1].policy is rec.policy
    if torch.compiler.is_compiling():
        return False  # traced outside any policy region; compiled recompute replays the graph
    if torch._C._current_graph_task_id() != -1:
        return rec.live  # checkpoint recomputation: replay the latest forward's rule
    rec.live = False  # a forward outside any policy region: forget the rule
    return False


def _instance_pre(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    rec = _record(module)
    rule = None if rec is None else rec.rule
    if rec is None or rule is None or not _rule_active(rec):
        TLS.applied.append((id(module), None))
        return None
    if not torch.is_autocast_enabled(rec.device_type):
        TLS.applied.append((id(module), None))
        return None
    saved, args, kwargs = _enter_rule(rule, rec, args, kwargs, module)
    TLS.applied.append((id(module), (saved, rule, first_floating_dtype(args, kwargs), rec)))
    return args, kwargs


def _enter_rule(
    rule: Rule, rec: _Record, args: tuple[Any, ...], kwargs: dict[str, Any], module: nn.Module
) -> tuple[tuple[bool, torch.dtype, bool, Any], tuple[Any, ...], dict[str, Any]]:
    dev = rec.device_type
    saved = (
        torch.is_autocast_enabled(dev),
        torch.get_autocast_dtype(dev),
        torch.is_autocast_cache_enabled(),
        None,  # what fp8.enter_rule returned
    )
    if rule.fp8_family:
        return (*saved[:3], fp8.enter_rule(module, rule, rec, _MAPS_BUILT[0])), args, kwargs
    if rule.compute in ("fp32", "keep"):
        torch.set_autocast_enabled(dev, False)
        if rule.compute == "fp32":
            args, kwargs = cast_tree(args, kwargs, dev, torch.float32)
        return saved, args, kwargs
    target = rule.compute_dtype(rec.low)
    if target is not None and target != saved[1]:
        torch.set_autocast_dtype(dev, target)
        torch.set_autocast_cache_enabled(False)  # the cast cache is not keyed by dtype
    return saved, args, kwargs


def _instance_post(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Any:
    tls = TLS
    if not tls.applied or tls.applied[-1][0] != id(module):
        return None  # our pre-hook did not run for this call (an earlier pre-hook raised)
    entry = tls.applied.pop()[1]
    if entry is None:
        return None
    saved, rule, in_dtype, rec = entry
    fp8.exit_rule(saved[3])
    dev = rec.device_type
    torch.set_autocast_enabled(dev, saved[0])
    torch.set_autocast_dtype(dev, saved[1])
    torch.set_autocast_cache_enabled(saved[2])
    out_dtype = rule.output_dtype(rec.low, in_dtype)
    if out_dtype is None or output is None:
        return None
    return cast_value(output, dev, out_dtype)


# ---------------------------------------------------------------- global registration
_LOCK = threading.Lock()
_GLOBAL: dict[str, Any] = {"pre": 0, "post": 0, "pre_handle": None, "post_handle": None}


def _hook_dict(kind: str) -> dict[int, Any]:
    return nn_module._global_forward_pre_hooks if kind == "pre" else nn_module._global_forward_hooks


def acquire_global_hooks(post: bool = False) -> None:
    """Register the process-wide discovery hooks (reference counted across regions and threads).

    The forward pre-hook names and binds modules; the forward post-hook, needed only by the dtype
    report, keeps the stack of module names. Handles are created once and re-inserted, since
    creating hook handles is dearer than running the hooks on a small model.

    Example:
        >>> acquire_global_hooks(); release_global_hooks()

    Host sync: none.
    """
    with _LOCK:
        for kind in ("pre", "post") if post else ("pre",):
            _GLOBAL[kind] += 1
            if _GLOBAL[kind] > 1:
                continue
            handle = _GLOBAL[f"{kind}_handle"]
            if handle is None:
                handle = (
                    nn_module.register_module_forward_pre_hook(_global_pre)
                    if kind == "pre"
                    else nn_module.register_module_forward_hook(_global_post, always_call=True)
                )
                _GLOBAL[f"{kind}_handle"] = handle
            else:
                _hook_dict(kind)[handle.id] = _global_pre if kind == "pre" else _global_post
                if kind == "post":
                    nn_module._global_forward_hooks_always_called[handle.id] = True


def release_global_hooks(post: bool = False) -> None:
    """Drop one reference to the discovery hooks; the last one removes them.

    Example:
        >>> acquire_global_hooks(); release_global_hooks()

    Host sync: none.
    """
    with _LOCK:
        for kind in ("pre", "post") if post else ("pre",):
            _GLOBAL[kind] -= 1
            if _GLOBAL[kind] == 0:
                _GLOBAL[f"{kind}_handle"].remove()
