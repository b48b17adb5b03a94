"""Everything autocast does for fp8-family module rules, in one place.

The formats and recipes live in :mod:`mixprec._src.fp8` (which knows nothing of autocast); a
recipe registered there is a rule word here at once (``"fp8:<recipe>"``, through
:data:`~.rules.KINDS`). This module is the seam between the two:

- **which modules a rule serves** (:func:`fp8_targets`): a rule on a module applies to its whole
  subtree, and fp8 is no exception: ``"encoder=fp8"`` runs every Linear inside ``encoder`` in fp8,
  except under descendants that have a rule of their own;
- **the checks**: a class rule on a class fp8 cannot serve (:func:`check_class_rule`, when the
  policy is built), a name rule that reaches no Linear at all or a rule that reaches an
  ``nn.MultiheadAttention`` (:func:`check_reach`, when a model first runs under the policy) and
  a class rule that served no module in a whole region (:func:`check_class_reach`, when the
  region exits) are errors, never rules that silently do nothing;
- **entering and leaving** a module that carries an fp8 rule (:func:`enter_rule`,
  :func:`exit_rule`), called by the module-rule hooks (:mod:`.modules`, which find and keep the
  served modules) in place of the native state switch the other rules make: the module's own
  matmuls run on fp8 operands and the region's dtype stays around them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec._src.autocast.rules import Rule
from mixprec._src.autocast.targets import class_label
from mixprec._src.fp8 import hook
from mixprec._src.fp8.hook import SERVES, can_serve
from mixprec._src.fp8.matmul import use_scaled_mm
from mixprec._src.fp8.recipes import RECIPES, get_recipe
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
        if isinstance(mod, nn.MultiheadAttention):
            raise ConfigError(_attention_message(qual))
        if can_serve(type(mod)):
            found.append((qual, mod))
        for child_name, child in reversed(list(mod.named_children())):
            child_qual = f"{qual}.{child_name}" if qual else child_name
            if policy is None or policy.module_rule(child, child_qual) is None:
                pending.append((child_qual, child))
    return tuple(found)


def check_reach(root: nn.Module, policy: Policy) -> None:
    """Refuse an fp8 name rule that governs modules of ``root`` but reaches none of its Linears,
    and any fp8 rule that reaches an ``nn.MultiheadAttention``; note which fp8 class rules serve
    a module of ``root`` (for :func:`check_class_reach`).

    Example:
        >>> from mixprec import Policy
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
        >>> check_reach(net, Policy("0=fp8"))
        >>> check_reach(net, Policy("1=fp8"))
        Traceback (most recent call last):
        ...
        mixprec.errors.ConfigError: module rule '1=fp8' reaches no Linear module: ...

    Raises:
        ConfigError: names the rule, what it matched, and the Linear modules there are; or the
            attention module and the fix.

    Host sync: none.
    """
    named = list(root.named_modules())
    classes = {t: r for t, r in policy.class_rules.items() if r.fp8_family}
    globs = [(g, r) for g, r in policy.name_rules.items() if r.fp8_family]
    if not (classes or globs):
        return
    _check_attention(named, policy)
    for glob, rule in globs:
        governed = [
            (n, m)
            for n, m in named
            if fnmatch.fnmatchcase(n, glob) and policy.module_rule(m, n) is rule
        ]
        if governed and not any(fp8_targets(m, n, policy) for n, m in governed):
            raise ConfigError(_unreached_message(glob, rule, governed, named))
    reached = set()
    for n, m in named:
        own = policy.module_rule(m, n)
        cls = next((c for c in type(m).__mro__ if c in classes), None)
        if cls is not None and own is classes[cls] and fp8_targets(m, n, policy):
            reached.add(cls)
    root.__dict__[_REACHED_ATTR] = (policy, reached)


_REACHED_ATTR = "_mixprec_fp8_reached"


def check_class_reach(policy: Policy, roots: list[nn.Module]) -> ConfigError | None:
    """The error for fp8 class rules that served no module of the models run in a region
    (``"nn.Linear=fp8"`` on a model without a Linear), or None.

    Example:
        >>> from mixprec import Policy
        >>> net = nn.Sequential(nn.Conv1d(2, 2, 1))
        >>> check_reach(net, Policy("nn.Linear=fp8"))
        >>> print(check_class_reach(Policy("nn.Linear=fp8"), [net]))
        module rule nn.Linear=fp8 served no module in this region: ...

    Host sync: none.
    """
    wanted = {t: r for t, r in policy.class_rules.items() if r.fp8_family}
    if not wanted:
        return None
    reached: set[type] = set()
    for root in roots:
        noted = root.__dict__.get(_REACHED_ATTR)
        if noted is None or noted[0] != policy:
            return None  # not prepared under this policy: nothing known, nothing claimed
        reached |= noted[1]
    missing = [f"{class_label(t)}={r}" for t, r in wanted.items() if t not in reached]
    if not missing:
        return None
    models = ", ".join(type(r).__name__ for r in roots[:3])
    return ConfigError(
        f"module rule {', '.join(missing)} served no module in this region: the models run "
        f"here ({models}) hold no module of that class that fp8 can serve (fp8 serves "
        f"{SERVES}). Drop the rule, name the modules it should serve, or pass "
        "Policy(..., strict=False) to allow it."
    )


def _check_attention(named: list[tuple[str, nn.Module]], policy: Policy) -> None:
    """Refuse an fp8 rule on an ``nn.MultiheadAttention`` or on its ``out_proj`` (unless the
    attention module has a rule of its own that is not fp8: then it runs in that)."""
    for n, m in named:
        if not isinstance(m, nn.MultiheadAttention):
            continue
        own = policy.module_rule(m, n)
        proj = policy.module_rule(m.out_proj, f"{n}.out_proj" if n else "out_proj")
        if (own is not None and own.fp8_family) or (
            own is None and proj is not None and proj.fp8_family
        ):
            raise ConfigError(_attention_message(n))


def _attention_message(name: str) -> str:
    shown = repr(name) if name else "the model"
    return (
        f"an fp8 rule reaches nn.MultiheadAttention {shown}: its forward calls "
        "F.multi_head_attention_forward with its packed projection weights, so no fp8 rule can "
        "serve its projections (out_proj's own forward never runs). Give it a rule of its own "
        f"that is not fp8 (e.g. '{name or '<module>'}=bf16', or "
        "Policy(modules={nn.MultiheadAttention: 'bf16'})), or build the attention from "
        "nn.Linear projections and F.scaled_dot_product_attention."
    )


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


def enter_rule(recipe: str, targets: Sequence[tuple[str, nn.Module]], low: torch.dtype) -> Any:
    """Start serving an fp8 rule with ``recipe`` (``Rule.recipe``) on ``targets`` (what
    :func:`fp8_targets` found, as ``(qualified name, Linear)`` pairs), with ``low`` the region's
    dtype around the matmuls; return the token :func:`exit_rule` takes.

    Example:
        >>> import torch
        >>> lin = nn.Linear(4, 2)
        >>> token = enter_rule("rowwise", fp8_targets(lin, "lin", None), torch.bfloat16)
        >>> y = lin(torch.randn(3, 4)); exit_rule(token)

    Host sync: none.
    """
    return hook.enter_modules(targets, get_recipe(recipe), low)


def exit_rule(token: Any) -> None:
    """Undo :func:`enter_rule` (``None``, what a module without an fp8 rule holds: nothing).

    Example:
        >>> exit_rule(None)

    Host sync: none.
    """
    hook.exit_module(token)


def matmul_path(rule: str, device: torch.device | str) -> str:
    """Which path the matmuls of a Linear under an fp8-family ``rule`` take on ``device``:
    ``"hardware"`` (``torch._scaled_mm``, with block scales for the block recipes) or
    ``"emulated"`` (the casts' values dequantized to fp32 and an fp32 matmul, on every device).

    The answer is for shapes the kernels take (multiples of 16); a matmul of other shapes is
    emulated, and :class:`~mixprec.Fp8Stats` says what ran (``path`` per module). The rule is read
    as a policy reads it; an output cast (``"fp8:rowwise@fp32"``) does not matter here.

    Example:
        >>> matmul_path("mxfp8", "cpu")
        'emulated'

    Raises:
        ConfigError: ``rule`` is not an fp8-family rule word, or ``device`` is not a device.

    Host sync: none (a CUDA device's compute capability is read once per device).
    """
    try:
        parsed = Rule.coerce(rule)
    except ConfigError as err:
        raise ConfigError(f"matmul_path takes an fp8-family rule word: {err}") from None
    if not parsed.fp8_family or parsed.recipe is None:
        raise ConfigError(
            f"matmul_path takes an fp8-family rule word (such as 'fp8:rowwise', 'mxfp8', "
            f"'nvfp4'), got {rule!r}"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"matmul_path: {device!r} is not a device ({err})") from None
    return "hardware" if use_scaled_mm(dev, RECIPES[parsed.recipe]) else "emulated"
