"""The policy that says what the search chose: class rules with exceptions, or name rules; and a
policy with some modules' forward matmuls moved to 16-bit (what the watch proposes)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.rules import Rule, RuleLike
from mixprec._src.fp8.recipes import HIGH
from mixprec._src.torch_compat import public_attr
from mixprec.errors import ConfigError


def build_policy(
    model: nn.Module, choices: dict[str, str], region_word: str, measured: Sequence[str]
) -> Policy:
    """The policy for ``choices`` (module name -> rule word) in a region of ``region_word``.

    Modules in the region's own dtype need no rule. When every module of a torch.nn class in the
    model is measured and most of them share a rule, one class rule plus exceptions is written
    (``nn.Linear=fp8, lm_head=bf16``); otherwise one name rule per module.
    """
    rules: dict[object, str] = {}
    named = dict(model.named_modules())
    handled: set[str] = set()
    measured_set = set(measured)
    for cls in _nn_classes([named[n] for n in measured]):
        members = [n for n, m in named.items() if isinstance(m, cls) and n]
        if not members or not set(members) <= measured_set:
            continue
        words = [choices[n] for n in members]
        common = max(sorted(set(words)), key=words.count)
        exceptions = [n for n in members if choices[n] != common]
        plain = sum(w != region_word for w in words)
        if common == region_word or words.count(common) < 2 or 1 + len(exceptions) >= plain:
            continue
        rules[cls] = common
        rules.update({_exact(n): choices[n] for n in exceptions})
        handled |= set(members)
    for n in measured:
        if n not in handled and choices[n] != region_word:
            rules[_exact(n)] = choices[n]
    return _round_tripped(rules)


def _exact(name: str) -> str:
    """A name glob that matches exactly ``name`` (glob characters in it are escaped)."""
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in name)


def _nn_classes(modules: Sequence[nn.Module]) -> list[type[nn.Module]]:
    seen: list[type[nn.Module]] = []
    for m in modules:
        cls = type(m)
        if public_attr(nn, cls.__name__, None) is cls and cls not in seen:
            seen.append(cls)
    return seen


def _round_tripped(rules: dict[object, str]) -> Policy:
    policy = Policy(modules=rules)
    try:
        same = Policy(str(policy)) == policy
    except ConfigError:
        same = False
    if not same:
        raise ConfigError(
            f"the proposed policy {str(policy)!r} does not survive its string form: a module "
            "name contains a character the policy syntax uses (',', ';' or a line break); "
            "rename the module, or leave it out with modules=[...]"
        )
    return policy


def rule_in_force(policy: Policy, model: nn.Module, name: str) -> Rule | None:
    """The rule ``policy`` gives module ``name`` of ``model``: its own, else its nearest
    container's (a container's rule reaches its subtree)."""
    named = dict(model.named_modules())
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        qual = ".".join(parts[:depth])
        rule = policy.module_rule(named[qual], qual)
        if rule is not None:
            return rule
    return None


def forward_high(
    policy: Policy, model: nn.Module, names: Sequence[str], high: str
) -> tuple[Policy, list[str]]:
    """``policy`` with the fprop matmul of each module in ``names`` that runs a low-precision
    recipe there moved to ``high`` (an exact name rule each, tried first), and what changed
    (``"name: old -> new"``)."""
    extra: dict[object, Rule] = {}
    changes = []
    for name in names:
        rule = rule_in_force(policy, model, name)
        if rule is None or rule.matmuls is None or rule.matmuls[0] in HIGH:
            continue
        new = rule.with_matmuls(fprop=high)
        extra[_exact(name)] = new
        changes.append(f"{name}: {rule} -> {new}")
    if not extra:
        return policy, []
    modules: dict[object, RuleLike] = {**extra}
    modules.update({k: v for k, v in policy.modules.items() if k not in extra})
    ops: dict[object, RuleLike] = {label: rule for label, rule in policy.ops.items()}
    switched = Policy(modules=modules, ops=ops, strict=policy.strict)
    idle = _idle_classes(switched, model)  # every member now has a name rule of its own
    if idle:
        kept = {k: v for k, v in modules.items() if k not in idle}
        switched = Policy(modules=kept, ops=ops, strict=policy.strict)
    return switched, changes


def _idle_classes(policy: Policy, model: nn.Module) -> set[type[nn.Module]]:
    """The class rules of ``policy`` that were in force somewhere in ``model`` and no module
    takes any more."""
    taken = set()
    for name, module in model.named_modules():
        found = policy.rule_source(module, name)
        if found is not None:
            taken.add(found[0])
    present = {
        cls for cls in policy.class_rules if any(isinstance(m, cls) for m in model.modules())
    }
    return present - taken
