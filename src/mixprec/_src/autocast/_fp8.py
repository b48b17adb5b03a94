"""Where an fp8 module rule reaches: the Linear modules under the module it names.

A rule on a module applies to its whole subtree, and fp8 is no exception: ``"encoder=fp8"`` runs
every Linear inside ``encoder`` in fp8, except under descendants that have a rule of their own.
A name rule that reaches no Linear at all is an error, never a rule that silently does nothing.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from mixprec._src.autocast.policy import Policy
from mixprec._src.fp8.hook import SERVES, can_serve
from mixprec.errors import ConfigError


def fp8_targets(
    module: nn.Module, name: str, policy: Policy | None
) -> tuple[tuple[str, nn.Module], ...]:
    """The Linear modules an fp8 rule on ``module`` serves: those in its subtree, with their
    qualified names, leaving out the subtrees of descendants that have a rule of their own
    (theirs applies there, as for every other rule).

    Example:
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


def check_fp8_reach(root: nn.Module, policy: Policy) -> None:
    """Refuse an fp8 name rule that governs modules of ``root`` but reaches none of its Linears.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
        >>> check_fp8_reach(net, Policy("0=fp8"))
        >>> check_fp8_reach(net, Policy("1=fp8"))
        Traceback (most recent call last):
        ...
        mixprec.errors.ConfigError: module rule '1=fp8' reaches no Linear module: ...

    Raises:
        ConfigError: names the rule, what it matched, and the Linear modules there are.

    Host sync: none.
    """
    globs = [(g, r) for g, r in policy.name_rules.items() if r.compute == "fp8"]
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
