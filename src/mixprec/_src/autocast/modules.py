"""Module rules: names, the rule each module gets, and the hooks that apply it.

While a region with module rules or a report is active, two process-wide module hooks (registered
on entry, removed at the last exit) name each module that runs and bind it to its rule. A module
with a rule gets a pair of per-instance hooks once; they apply the rule by switching the *native*
autocast state, which is what makes rules survive ``torch.utils.checkpoint`` recomputation:
recompute runs in backward, outside the region, with the native state restored by checkpoint, and
the per-module hooks replay the rule bound at the module's latest forward. (Op rules replay through
the checkpoint itself: :mod:`.ops`.) A rule of the fp8 family enters and leaves through :mod:`.fp8`
instead of switching the native state.

**Names.** A module is named relative to its *root*, the module called at the top of the region
whose tree contains it. Each root keeps a :class:`_Tree` (id -> qualified name and the path of
keys to it, and the rules each policy gives its modules); a name is used only while its path
still leads to its module, so moving, swapping or dropping modules renames them at their next
call. Nothing here holds a user's module after the region: roots are held by the region's frames
only, trees hold ids and names.

**Subtrees.** A rule applies to the subtree of the module it names: whatever that module's forward
runs, and the modules of a container that is never called itself (a class without ``forward``,
such as ``nn.ModuleList`` or ``nn.ModuleDict``), each of which gets the container's rule.

**torch.compile.** Dynamo traces these hooks. While tracing, the per-instance hooks do nothing and
the global hooks apply the rule themselves; the rule comes from :func:`_compiled_rule`, which Dynamo
runs eagerly at trace time (``assume_constant_result``) and guards on the identity of its arguments,
the module and the region's policy: another policy recompiles or takes another cached graph.
Dynamo never compiles a hook on its own (:func:`.native.never_compiled_alone`): where it skips
torch's frames (``model.compile()`` of a torch.nn container), the hooks run eagerly with the model.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch._compile import _disable_dynamo
from torch.fx import GraphModule
from torch.nn.modules import module as nn_module
from torch.overrides import TorchFunctionMode

from mixprec._src.autocast import fp8
from mixprec._src.autocast.casting import cast_tree, cast_value, first_floating_dtype
from mixprec._src.autocast.native import backward_autocast_off_while_tracing, never_compiled_alone
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.rules import Rule, compute_dtype, output_dtype
from mixprec.errors import ConfigError


class Frame:
    """The mixprec part of one active region in one thread. Host sync: none."""

    __slots__ = ("device_type", "dtype", "enabled", "policy", "roots", "stack_len")

    def __init__(
        self, device_type: str, dtype: torch.dtype, enabled: bool, policy: Policy | None
    ) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self.enabled = enabled
        self.policy = policy
        self.roots: list[nn.Module] = []  # the roots that ran while this frame was innermost
        self.stack_len = 0


class _Tls(threading.local):
    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.stack: list[str] = []  # qualified names of the running modules (for a report)
        self.applied: list[Any] = []  # what each rule's pre-hook did, for its post-hook
        self.roots: list[tuple[nn.Module, _Tree]] = []  # the region's roots, newest last
        self.current: tuple[nn.Module, _Tree] | None = None  # the root of the last lookup
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
    return sorted({n for root in frame.roots for n, _ in _tree_of(root).names.values()})


# ---------------------------------------------------------------- names and plans
# Per-module state lives in instance attributes with this prefix (the advisor removes them after
# its passes; deepcopy and pickle copy them, and a copied tree is rebuilt at first use).
_REC_ATTR = "_mixprec_rule"
_TREE_ATTR = "_mixprec_tree"
_PLANS_KEPT = 8
_VERSION = [0]  # plans made so far: a plan's version tells a cached fp8 target list its age


def _never_called(module: nn.Module) -> bool:
    return type(module).forward is nn.Module.forward


def _is_wrapper(module: nn.Module) -> bool:
    """torch.compile's ``OptimizedModule``: its inner module is the one named and bound."""
    return type(module).__name__ == "OptimizedModule" and "_orig_mod" in module._modules


class _Plan:
    """The effective rule of each module of one tree under one policy (by module id)."""

    __slots__ = ("rules", "version")

    def __init__(self, rules: dict[int, Rule]) -> None:
        _VERSION[0] += 1
        self.rules = rules
        self.version = _VERSION[0]


class _Tree:
    """The qualified names of one root's modules, with the keys that lead to each, and the plans
    of the policies it ran under (a few, newest last)."""

    __slots__ = ("names", "plans")

    def __init__(self, root: nn.Module) -> None:
        self.names: dict[int, tuple[str, tuple[str, ...]]] = {
            id(m): (n, tuple(n.split(".")) if n else ())
            for n, m in root.named_modules(remove_duplicate=False)
        }
        self.plans: dict[Policy, _Plan] = {}


def _at(root: nn.Module, keys: tuple[str, ...]) -> nn.Module | None:
    module: nn.Module | None = root
    for key in keys:
        module = module._modules.get(key) if module is not None else None
    return module


def _tree_of(root: nn.Module, fresh: bool = False) -> _Tree:
    tree: _Tree | None = None if fresh else root.__dict__.get(_TREE_ATTR)
    if tree is None:
        tree = _Tree(root)
        object.__setattr__(root, _TREE_ATTR, tree)
    return tree


def _find(root: nn.Module, tree: _Tree, module: nn.Module) -> tuple[_Tree, str | None]:
    """The module's name in ``root``'s tree (rebuilt if its entry no longer leads to it)."""
    entry = tree.names.get(id(module))
    if entry is None:
        return tree, None
    if _at(root, entry[1]) is module:
        return tree, entry[0]
    tree = _tree_of(root, fresh=True)  # moved, swapped or dropped modules: names again
    entry = tree.names.get(id(module))
    return tree, None if entry is None else entry[0]


def _locate(module: nn.Module, frame: Frame) -> tuple[nn.Module, _Tree, str]:
    """The root, tree and qualified name of a module that runs in the region."""
    tls = TLS
    if tls.current is not None:
        root, tree = tls.current
        entry = tree.names.get(id(module))
        if entry is not None and _at(root, entry[1]) is module:
            return root, tree, entry[0]
    for rebuild in (False, True):  # the second pass: modules added to a root since
        for i, (root, tree) in enumerate(tls.roots):
            tree, name = _find(root, _tree_of(root, fresh=True) if rebuild else tree, module)
            tls.roots[i] = (root, tree)
            if name is not None:
                return _entered(frame, root, tree, name)
        if module.__dict__.get(_TREE_ATTR) is not None:
            break  # a root of an earlier region: a root again
    tree = _tree_of(module)
    tls.roots.append((module, tree))
    return _entered(frame, module, tree, "")


def _entered(frame: Frame, root: nn.Module, tree: _Tree, name: str) -> tuple[nn.Module, _Tree, str]:
    TLS.current = (root, tree)
    if not any(r is root for r in frame.roots):
        frame.roots.append(root)
    return root, tree, name


def _plan_of(root: nn.Module, tree: _Tree, policy: Policy, attach: bool, skip: object) -> _Plan:
    """The plan of ``policy`` over ``root``'s tree: made once per tree and policy, checked (fp8
    reach), and with hooks attached before the modules run (``attach``; never while tracing),
    except on ``skip``, the module whose call has started."""
    plan = tree.plans.get(policy)
    if plan is not None:
        return plan
    fp8.check_reach(root, policy)
    rules: dict[int, Rule] = {}
    passed: dict[str, Rule | None] = {}
    for name, mod in root.named_modules(remove_duplicate=False):
        rule = policy.module_rule(mod, name)
        if rule is None and name:
            rule = passed.get(name.rpartition(".")[0])  # a never-called container's rule
        passed[name] = rule if _never_called(mod) else None
        if rule is None:
            rules.pop(id(mod), None)
            continue
        rules[id(mod)] = rule
        if attach and mod is not skip and _record(mod) is None:
            _attach(mod)
    plan = tree.plans[policy] = _Plan(rules)
    while len(tree.plans) > _PLANS_KEPT:
        tree.plans.pop(next(iter(tree.plans)))
    return plan


# ---------------------------------------------------------------- per-module records
class _Record:
    def __init__(self) -> None:
        self.policy: Policy | None = None
        self.name: str | None = None
        self.rule: Rule | None = None
        self.version = 0  # of the plan that gave the rule
        self.device_type = "cpu"
        self.low = torch.float16
        self.live = False
        self.handles: list[Any] = []
        self.fp8: Any = None  # (plan version, served modules) of an fp8 rule


def _record(module: nn.Module) -> _Record | None:
    return module.__dict__.get(_REC_ATTR)


def _bind(frame: Frame, module: nn.Module, name: str, plan: _Plan) -> bool:
    """Bind ``module`` to its rule in the frame's plan; True when its hooks were attached just now
    (so they did not run for this call). Hooks go on modules with a rule only."""
    rule = plan.rules.get(id(module))
    rec = _record(module)
    fresh = False
    if rec is None:
        if rule is None:
            return False
        rec, fresh = _attach(module), True
    rec.policy, rec.name, rec.rule, rec.version = frame.policy, name, rule, plan.version
    rec.device_type, rec.low, rec.live = frame.device_type, frame.dtype, frame.enabled
    return fresh


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
        mod.__dict__.pop(_TREE_ATTR, None)
        if rec is not None:
            for handle in rec.handles:
                handle.remove()
            count += 1
    return count


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
    root, tree, name = _locate(module, frame)
    if tls.reporting:
        tls.stack.append(name)
    if policy is None:
        return None
    plan = _plan_of(root, tree, policy, attach=True, skip=module)
    if _bind(frame, module, name, plan):
        # First call of a module with a rule and no hooks yet (typically the root): its own
        # pre-hook list was read before we attached, so apply the rule here (positional inputs
        # only); its post-hook list is read after forward, so the instance post-hook restores.
        result = _instance_pre(module, args, {})
        return None if result is None else result[0]
    return None


@never_compiled_alone
def _global_post(module: nn.Module, args: Any, output: Any) -> Any:
    tls = TLS
    if not tls.frames or isinstance(module, GraphModule):
        return None
    if torch.compiler.is_compiling():
        frame = tls.frames[-1]
        return None if frame.policy is None else _traced_post(module, frame.policy, frame, output)
    if len(tls.stack) > tls.frames[-1].stack_len and not _is_wrapper(module):
        tls.stack.pop()
    return None


# ---------------------------------------------------------------- rules under torch.compile
def _compiled_rule(module: nn.Module, policy: Policy) -> Any:
    """While Dynamo traces: the module's rule as plain values ``(compute, output, recipe, keys,
    fp8_family)`` (``keys``: for an fp8-family rule, the names and key paths of the Linear modules
    it serves), or None.
    Run eagerly at trace time (marked below), so names, trees and checks work as in eager mode;
    Dynamo guards on ``module`` and ``policy`` by identity, which is what makes a compiled graph
    depend on the region's policy."""
    backward_autocast_off_while_tracing()
    frame = TLS.frames[-1]
    try:
        root, tree, name = _locate(module, frame)
        rule = _plan_of(root, tree, policy, attach=False, skip=None).rules.get(id(module))
        if rule is None:
            return None
        keys: tuple[tuple[str, tuple[str, ...]], ...] = ()
        if rule.fp8_family:
            paths = {id(m): k for k, m in module.named_modules(remove_duplicate=False)}
            served = fp8.fp8_targets(module, name, policy)
            keys = tuple(
                (n, tuple(paths[id(m)].split(".")) if paths[id(m)] else ()) for n, m in served
            )
    except ConfigError as error:  # raised eagerly below, not as an error of Dynamo's
        return str(error)
    return rule.compute, rule.output, rule.recipe, keys, rule.fp8_family


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
    for entry in reversed(TLS.applied):
        if entry is not None and len(entry) == 5:
            return entry[3]
        if entry is not None:
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
    compute, output, recipe, keys, family = found
    dev = frame.device_type
    enabled, low = _traced_state(dev)
    if not frame.enabled or not enabled:
        TLS.applied.append(None)  # rules act only where autocast is on
        return None
    saved: Any = None
    state: tuple[bool, torch.dtype] = (enabled, low)
    if family:
        targets = [(n, _at(module, k)) for n, k in keys]  # each key path leads to its Linear
        saved = fp8.enter_rule(recipe, targets, frame.dtype)  # type: ignore[arg-type]
    else:
        on = compute not in ("fp32", "keep")
        target = compute_dtype(compute, frame.dtype) if on else low
        if compute == "fp32":
            args = cast_tree(args, {}, dev, torch.float32)[0]
        if target is not None and (not on or target != low):
            saved = _TracedRegion(dev, target, on)
            saved.__enter__()
            state = (on, target)
    TLS.applied.append((saved, output, first_floating_dtype(args, {}), state, family))
    return args


def _traced_post(module: nn.Module, policy: Policy, frame: Frame, output: Any) -> Any:
    if not isinstance(_compiled_rule(module, policy), tuple):
        return None
    if not TLS.applied or (TLS.applied[-1] is not None and len(TLS.applied[-1]) != 5):
        return None  # not an entry of _traced_pre's (an eager one, after a graph break)
    entry = TLS.applied.pop()
    if entry is None:
        return None
    saved, cast, in_dtype, _, is_fp8 = entry
    if is_fp8:
        fp8.exit_rule(saved)
    elif saved is not None:
        saved.__exit__(None, None, None)
    out_dtype = output_dtype(cast, frame.dtype, in_dtype)
    if out_dtype is None or output is None:
        return None
    return cast_value(output, frame.device_type, out_dtype)


# ---------------------------------------------------------------- per-module hooks
def _rule_active(rec: _Record) -> bool:
    frames = TLS.frames
    if frames:
        return rec.live and frames[-1].policy is rec.policy
    if torch._C._current_graph_task_id() != -1:
        return rec.live  # checkpoint recomputation: replay the latest forward's rule
    rec.live = False  # a forward outside any policy region: forget the rule
    return False


@never_compiled_alone
def _instance_pre(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if torch.compiler.is_compiling():
        return None  # the global hooks apply rules in traced code
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
        if rec.fp8 is None or rec.fp8[0] != rec.version:
            rec.fp8 = (rec.version, fp8.fp8_targets(module, rec.name or "", rec.policy))
        assert rule.recipe is not None
        return (*saved[:3], fp8.enter_rule(rule.recipe, rec.fp8[1], rec.low)), args, kwargs
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


@never_compiled_alone
def _instance_post(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Any:
    if torch.compiler.is_compiling():
        return None
    tls = TLS
    if not tls.applied or tls.applied[-1] is None or tls.applied[-1][0] != id(module):
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
_GLOBAL: dict[str, Any] = {"count": 0, "handles": None}


def acquire_global_hooks() -> None:
    """Register the process-wide hooks (reference counted across regions and threads).

    The forward pre-hook names and binds modules; the forward post-hook keeps the stack of module
    names of a report and, while Dynamo traces, restores what a rule changed. Handles are created
    once and re-inserted, since creating hook handles is dearer than running the hooks on a small
    model.

    Example:
        >>> acquire_global_hooks(); release_global_hooks()

    Host sync: none.
    """
    with _LOCK:
        _GLOBAL["count"] += 1
        if _GLOBAL["count"] > 1:
            return
        handles = _GLOBAL["handles"]
        if handles is None:
            _GLOBAL["handles"] = (
                nn_module.register_module_forward_pre_hook(_global_pre),
                nn_module.register_module_forward_hook(_global_post, always_call=True),
            )
            return
        nn_module._global_forward_pre_hooks[handles[0].id] = _global_pre
        nn_module._global_forward_hooks[handles[1].id] = _global_post
        nn_module._global_forward_hooks_always_called[handles[1].id] = True


def release_global_hooks() -> None:
    """Drop one reference to the process-wide hooks; the last one removes them.

    Example:
        >>> acquire_global_hooks(); release_global_hooks()

    Host sync: none.
    """
    with _LOCK:
        _GLOBAL["count"] -= 1
        if _GLOBAL["count"] == 0:
            for handle in _GLOBAL["handles"]:
                handle.remove()


def module_records(model: nn.Module) -> dict[int, dict[str, Any]]:
    """What mixprec.autocast keeps on each module of ``model`` (its ``_mixprec_*`` instance
    attributes), by module id: what :func:`restore_module_records` puts back.

    Host sync: none.
    """
    return {
        id(m): {k: v for k, v in m.__dict__.items() if k.startswith("_mixprec_")}
        for m in model.modules()
    }


def restore_module_records(model: nn.Module, records: dict[int, dict[str, Any]]) -> None:
    """Put back what :func:`module_records` took: records made since are removed (a rule
    record's hooks with it).

    Host sync: none.
    """
    for mod in model.modules():
        before = records.get(id(mod), {})
        for key in [k for k in mod.__dict__ if k.startswith("_mixprec_") and k not in before]:
            value = mod.__dict__.pop(key)
            if key == _REC_ATTR:
                for handle in getattr(value, "handles", ()):
                    handle.remove()
        mod.__dict__.update(before)


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
