"""Module names and the rule each module gets, resolved from its place in the model tree.

A module is named relative to its *root*, the module called at the top of the region whose tree
contains it. Each root has a :class:`Tree` (id -> qualified name and the path of keys to it, and
the :class:`RulePlan` of each policy it ran under), kept in a weak table beside the model, never on
it; a name is used only while its path still leads to its module, so moving, swapping or dropping
modules renames them at their next call.

A rule applies to the subtree of the module it names (its *owner*): each descendant without a
rule of its own gets the owner's as an :class:`Effective` rule, whatever calls it (the owner's
forward, a parent iterating the owner's children, checkpoint recomputation).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from torch import nn

from mixprec._src import torch_compat
from mixprec._src.autocast.fp8 import check_attention
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.rules import Rule
from mixprec._src.autocast.targets import module_places
from mixprec._src.fp8.hook import can_serve, computes_weight
from mixprec.errors import ConfigError

_PLANS_KEPT = 8


@dataclass(frozen=True)
class Effective:
    """The rule in force for one module of a tree under one policy.

    Attributes:
        owner: the qualified name of the module the rule names (the module itself or the
            nearest ancestor with a rule).
        rule: the rule.
        source: the policy key that gave it (a class or a name glob).
        guarded: an fp8-family rule that must serve a matmul in each forward of the module
            (the owner, where it holds a weight matrix, or a module under it that
            :func:`_serves_own_matrix`; a rule that served nothing in a whole region is refused
            at its exit).

    Host sync: none.
    """

    owner: str
    rule: Rule
    source: object
    guarded: bool


def _holds_matrix(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or any(p.dim() >= 2 for p in module.parameters())


def _serves_own_matrix(module: nn.Module) -> bool:
    """A module under an inherited fp8-family rule whose forward must serve a matmul: an
    ``nn.Linear``, or a module of a class fp8 can serve (outside torch.nn: ``Conv1D``, a custom
    projection) holding a weight matrix of its own. A torch.nn module that is not a Linear
    (an embedding, a convolution) keeps the region's dtype there, as a norm does."""
    if isinstance(module, nn.Linear):
        return True
    own = module.parameters(recurse=False)
    return can_serve(type(module)) and any(p.dim() >= 2 for p in own)


class RulePlan:
    """The effective rule of each module of one tree under one policy (by module id).

    A module reachable under several names (``nn.ModuleList([block] * 3)``, a module assigned to
    two parents) answers to each of them: its own rule is the one its names take
    (:meth:`Policy.rule_for`, an error where they disagree); without one it inherits from each
    of its parents, the first in torch's order where they give the same rule, an error where
    they give different ones. The owner is always named by its first name in torch's order,
    the name a call of it is known by.

    Host sync: none.
    """

    __slots__ = ("rules",)

    def __init__(self, root: nn.Module, policy: Policy) -> None:
        self.rules: dict[int, Effective] = {}
        places = module_places(root)
        parents: dict[int, list[int]] = {}
        at_name = {name: mod for mod, names in places.values() for name in names}
        for key, (_, names) in places.items():
            ups = (id(at_name[n.rpartition(".")[0]]) for n in names if n)
            parents[key] = list(dict.fromkeys(ups))
        done: dict[int, Effective | None] = {}
        for key in places:
            eff = _effective(key, policy, places, parents, done)
            if eff is not None:
                self.rules[key] = eff
        check_attention(root, self.rules)


def _effective(
    key: int,
    policy: Policy,
    places: dict[int, tuple[nn.Module, list[str]]],
    parents: dict[int, list[int]],
    done: dict[int, Effective | None],
) -> Effective | None:
    """The effective rule of module ``key`` (memoized in ``done``; parents first)."""
    if key in done:
        return done[key]
    mod, names = places[key]
    own = policy.rule_for(mod, names)
    computes = any(computes_weight(n) for n in names)  # a parametrization: never guarded
    if own is not None:
        guard = own[1].fp8_family and _holds_matrix(mod) and not computes
        eff: Effective | None = Effective(names[0], own[1], own[0], guard)
    else:
        ups = [e for p in parents[key] if (e := _effective(p, policy, places, parents, done))]
        if any(up.rule != ups[0].rule for up in ups):
            raise _inherits_two(names, ups)
        up = ups[0] if ups else None
        guard = up is not None and up.rule.fp8_family and _serves_own_matrix(mod) and not computes
        eff = None if up is None else Effective(up.owner, up.rule, up.source, guard)
    done[key] = eff
    return eff


def _inherits_two(names: list[str], ups: list[Effective]) -> ConfigError:
    taken = ", ".join(f"{up.owner!r} gives {up.rule}" for up in ups)
    return ConfigError(
        f"the module reachable as {', '.join(map(repr, names))} has no rule of its own and its "
        f"parents give it different rules ({taken}). One module object has one rule: give it "
        f"one by any of its names (e.g. '{names[0] or '(root)'}=<rule>') or by its class, or "
        "build separate modules (copy.deepcopy) to rule each place on its own"
    )


def rule_of(root: nn.Module, policy: Policy, module: nn.Module) -> Rule | None:
    """The rule ``policy`` gives ``module`` of the model ``root`` as its forward would (its own,
    by any of its names or its class, else its parents'), without running anything: what the
    watch asks. Nothing is kept.

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> rule_of(nn.Sequential(lin, nn.ReLU(), lin), Policy("2=fp32"), lin)
        Rule('fp32')

    Raises:
        ConfigError: the module's names, or its parents, give it different rules.

    Host sync: none.
    """
    eff = RulePlan(root, policy).rules.get(id(module))
    return None if eff is None else eff.rule


class Tree:
    """The qualified names of one root's modules (``names``: torch's first name of each, with
    the keys that lead to it; ``every``: all names, several for a module reachable by several
    paths), and the plans of the policies it ran under (a few, newest last). Host sync: none."""

    __slots__ = ("every", "names", "plans")

    def __init__(self, root: nn.Module) -> None:
        self.names: dict[int, tuple[str, tuple[str, ...]]] = {}
        every: list[str] = []
        for n, m in root.named_modules(remove_duplicate=False):
            self.names.setdefault(id(m), (n, tuple(n.split(".")) if n else ()))
            every.append(n)
        self.every: tuple[str, ...] = tuple(every)
        self.plans: dict[Policy, RulePlan] = {}

    def plan(self, root: nn.Module, policy: Policy) -> RulePlan:
        """The plan of ``policy`` over ``root`` (made once per tree and policy). Host sync:
        none."""
        found = self.plans.get(policy)
        if found is None:
            found = self.plans[policy] = RulePlan(root, policy)
            while len(self.plans) > _PLANS_KEPT:
                self.plans.pop(next(iter(self.plans)))
        return found


_TREES: weakref.WeakKeyDictionary[nn.Module, Tree] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def tree_of(root: nn.Module, fresh: bool = False) -> Tree:
    """The tree of ``root`` (built on first use, or again with ``fresh``).

    Example:
        >>> tree_of(nn.Sequential(nn.Linear(2, 2))).names.__len__()
        2

    Host sync: none.
    """
    tree = None if fresh else _TREES.get(root)
    if tree is None:
        tree = Tree(root)
        with _LOCK:
            _TREES[root] = tree
    return tree


def has_tree(module: nn.Module) -> bool:
    """Whether ``module`` was the root of a region before. Host sync: none."""
    return module in _TREES


def at(root: nn.Module, keys: tuple[str, ...]) -> nn.Module | None:
    """The module the key path leads to from ``root`` (None where it leads nowhere).

    Host sync: none.
    """
    module: nn.Module | None = root
    for key in keys:
        module = torch_compat.submodules(module).get(key) if module is not None else None
    return module


def find(root: nn.Module, tree: Tree, module: nn.Module) -> tuple[Tree, str | None]:
    """The module's name in ``root``'s tree (rebuilt if its entry no longer leads to it).

    Host sync: none.
    """
    entry = tree.names.get(id(module))
    if entry is None:
        return tree, None
    if at(root, entry[1]) is module:
        return tree, entry[0]
    tree = tree_of(root, fresh=True)  # moved, swapped or dropped modules: names again
    entry = tree.names.get(id(module))
    return tree, None if entry is None else entry[0]
