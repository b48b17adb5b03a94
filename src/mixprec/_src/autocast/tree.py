"""Module names and the rule each module gets, resolved from its place in the model tree.

A module is named relative to its *root*, the module called at the top of the region whose tree
contains it. Each root has a :class:`Tree` (id -> qualified name and the path of keys to it, and
the :class:`Plan` of each policy it ran under), kept in a weak table beside the model, never on
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
from mixprec._src.fp8.hook import can_serve, computes_weight

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


class Plan:
    """The effective rule of each module of one tree under one policy (by module id).

    Host sync: none.
    """

    __slots__ = ("rules",)

    def __init__(self, root: nn.Module, policy: Policy) -> None:
        self.rules: dict[int, Effective] = {}
        by_name: dict[str, Effective | None] = {}
        for name, mod in root.named_modules(remove_duplicate=False):
            own = policy.rule_source(mod, name)
            if own is not None:
                guard = own[1].fp8_family and _holds_matrix(mod) and not computes_weight(name)
                eff: Effective | None = Effective(name, own[1], own[0], guard)
            else:
                up = by_name.get(name.rpartition(".")[0]) if name else None
                guard = up is not None and up.rule.fp8_family and _serves_own_matrix(mod)
                guard = guard and not computes_weight(name)  # a parametrization
                eff = None if up is None else Effective(up.owner, up.rule, up.source, guard)
            by_name[name] = eff
            if eff is not None:
                self.rules[id(mod)] = eff
        check_attention(root, self.rules)


class Tree:
    """The qualified names of one root's modules, with the keys that lead to each, and the plans
    of the policies it ran under (a few, newest last). Host sync: none."""

    __slots__ = ("names", "plans")

    def __init__(self, root: nn.Module) -> None:
        self.names: dict[int, tuple[str, tuple[str, ...]]] = {
            id(m): (n, tuple(n.split(".")) if n else ())
            for n, m in root.named_modules(remove_duplicate=False)
        }
        self.plans: dict[Policy, Plan] = {}

    def plan(self, root: nn.Module, policy: Policy) -> Plan:
        """The plan of ``policy`` over ``root`` (made once per tree and policy). Host sync:
        none."""
        found = self.plans.get(policy)
        if found is None:
            found = self.plans[policy] = Plan(root, policy)
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


def forget_tree(module: nn.Module) -> bool:
    """Drop the names and plans kept for ``module`` as a root; True if there were any.

    Host sync: none.
    """
    with _LOCK:
        return _TREES.pop(module, None) is not None


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
