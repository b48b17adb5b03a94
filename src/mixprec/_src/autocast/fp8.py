"""Everything autocast does for fp8-family module rules, in one place.

The formats and recipes live in :mod:`mixprec._src.fp8` (which knows nothing of autocast); a
recipe registered there is a rule word here at once (``"fp8:<recipe>"``, through
:data:`~.rules.KINDS`). This module is the seam between the two:

- **which modules a rule serves** (:func:`fp8_targets`): a rule on a module applies to its whole
  subtree, and fp8 is no exception: ``"encoder=fp8"`` runs every Linear inside ``encoder`` in fp8,
  except under descendants that have a rule of their own;
- **the checks**: a class rule on a class fp8 cannot serve (:func:`check_class_rule`, when the
  policy is built) and a name rule that reaches no Linear at all (:func:`check_reach`, when a
  model first runs under the policy) are errors, never rules that silently do nothing;
- **entering and leaving** a module that carries an fp8 rule (:func:`enter_rule`,
  :func:`exit_rule`), called by the module-rule hooks (:mod:`.modules`) in place of the native
  state switch the other rules make: the module's own matmuls run on fp8 operands and the
  region's dtype stays around them.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any

from torch import nn

from mixprec._src.autocast.rules import Rule
from mixprec._src.autocast.targets import class_label
from mixprec._src.fp8 import hook
from mixprec._src.fp8.hook import SERVES, can_serve
from mixprec._src.fp8.recipes import get_recipe
from mixprec.errors import ConfigError

if TYPE_CHECKING:
    from mixprec._src.autocast.policy import Policy


def fp8_targets(
    module: nn.Module, name: str, policy: Policy | None
) -> tuple[tuple[str, nn.Module], ...]:
    """The Linear modules an fp8 rule on ``module`` serves: those in its subtree, with their
    qualified names, leaving out the subtrees of descendants that have a rule of their own
    (theirs applies there, as for every other rule).

    Example:
        >>> from mixprec import Policy
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
        >>> [n for n, _ in fp8_targets(net, "", Policy("2=fp32"))]
        ['0', '1.0']

    Host sync: none.
    """
    found: list[tuple[str, nn.Module]] = []
    pending = [(name, module)]
    while pending:
        qual, mod = pending.pop()
        if can_serve(type(mod)):
            found.append((qual, mod))
        for child_name, child in reversed(list(mod.named_children())):
            child_qual = f"{qual}.{child_name}" if qual else child_name
            if policy is None or policy.module_rule(child, child_qual) is None:
                pending.append((child_qual, child))
    return tuple(found)


def check_reach(root: nn.Module, policy: Policy) -> None:
    """Refuse an fp8 name rule that governs modules of ``root`` but reaches none of its Linears.

    Example:
        >>> from mixprec import Policy
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
        >>> check_reach(net, Policy("0=fp8"))
        >>> check_reach(net, Policy("1=fp8"))
        Traceback (most recent call last):
        ...
        mixprec.errors.ConfigError: module rule '1=fp8' reaches no Linear module: ...

    Raises:
        ConfigError: names the rule, what it matched, and the Linear modules there are.

    Host sync: none.
    """
    globs = [(g, r) for g, r in policy.name_rules.items() if r.fp8_family]
    if not globs:
        return
    named = list(root.named_modules())
    for glob, rule in globs:
        governed = [
            (n, m)
            for n, m in named
            if fnmatch.fnmatchcase(n, glob) and policy.module_rule(m, n) is rule
        ]
        if governed and not any(fp8_targets(m, n, policy) for n, m in governed):
            raise ConfigError(_unreached_message(glob, rule, governed, named))


def _unreached_message(
    glob: str,
    rule: object,
    governed: list[tuple[str, nn.Module]],
    named: list[tuple[str, nn.Module]],
) -> str:
    shown = ", ".join(f"{n!r} ({type(m).__name__})" for n, m in governed[:5])
    linears = [repr(n) for n, m in named if n and can_serve(type(m))][:5]
    there = f"Linear modules of this model: {', '.join(linears)}" if linears else "it has none"
    return (
        f"module rule '{glob}={rule}' reaches no Linear module: it matches {shown}, with no "
        f"Linear inside that another rule does not govern. fp8 serves {SERVES}. Name a Linear "
        f"or a module that contains one ({there}), or drop the rule."
    )


def check_class_rule(target: type[nn.Module] | str, rule: Rule) -> None:
    """Refuse an fp8 class rule on a module class fp8 cannot serve (when the policy is built).

    Example:
        >>> check_class_rule(nn.Linear, Rule("fp8"))
        >>> check_class_rule(nn.Conv2d, Rule("fp8"))
        Traceback (most recent call last):
        ...
        mixprec.errors.ConfigError: module rule nn.Conv2d=fp8: fp8 cannot serve Conv2d; ...

    Raises:
        ConfigError: names the rule and what fp8 serves.

    Host sync: none.
    """
    if rule.fp8_family and isinstance(target, type) and not can_serve(target):
        raise ConfigError(
            f"module rule {class_label(target)}={rule}: fp8 cannot serve {target.__name__}; "
            f"it serves {SERVES}"
        )


def enter_rule(module: nn.Module, rule: Rule, rec: Any, maps_built: int) -> Any:
    """Start serving the fp8 rule bound to ``module`` (its record ``rec``); return the token
    :func:`exit_rule` takes. The served Linears are found once per record and again after the
    name maps were rebuilt (``maps_built`` changed: modules were added or swapped), so that from
    the forward after that, new Linear modules under the rule are served too.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> lin = nn.Linear(4, 2)
        >>> rec = SimpleNamespace(name="", policy=None, low=torch.bfloat16, fp8=None)
        >>> token = enter_rule(lin, Rule("fp8"), rec, 0)
        >>> y = lin(torch.randn(3, 4)); exit_rule(token)
        >>> [name for name, _ in rec.fp8[1]]
        ['']

    Host sync: none.
    """
    assert rule.recipe is not None
    if rec.fp8 is None or rec.fp8[0] != maps_built:
        rec.fp8 = (maps_built, fp8_targets(module, rec.name or "", rec.policy))
    return hook.enter_modules(rec.fp8[1], get_recipe(rule.recipe), rec.low)


def exit_rule(token: Any) -> None:
    """Undo :func:`enter_rule` (``None``, what a module without an fp8 rule holds: nothing).

    Example:
        >>> exit_rule(None)

    Host sync: none.
    """
    hook.exit_module(token)
