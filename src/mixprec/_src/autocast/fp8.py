"""Everything autocast does for fp8-family module rules beyond the module hooks, in one place.

The formats and recipes live in :mod:`mixprec._src.fp8` (which knows nothing of autocast); a
recipe registered there is a rule word here at once (``"fp8:<recipe>"``, through
:data:`~.rules.KINDS`). A rule on a module applies to its whole subtree, fp8 too: the module
hooks (:mod:`.modules`) open a scope for each call under it, and the thread's fp8 mode serves the
matmuls on the weights of the innermost one (:mod:`mixprec._src.fp8.hook`), which refuses a
guarded module that served nothing. The checks here are the ones a forward cannot make:

- a class rule on a torch class fp8 cannot serve (:func:`check_class_rule`, when the policy is
  built);
- an fp8 rule on the ``out_proj`` of an ``nn.MultiheadAttention``, whose forward never runs
  (:func:`check_attention`, when a model first runs under the policy);
- a class rule that no module took in a whole region (:func:`check_class_reach`, when a strict
  region exits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec._src.autocast.rules import Rule
from mixprec._src.autocast.targets import class_label
from mixprec._src.fp8.hook import SERVES, attention_message, can_serve
from mixprec._src.fp8.matmul import use_scaled_mm
from mixprec._src.fp8.recipes import MATMULS, get_recipe
from mixprec.errors import ConfigError

if TYPE_CHECKING:
    from mixprec._src.autocast.policy import Policy


def check_class_reach(
    policy: Policy, ran: set[object], served: set[object], roots: list[nn.Module]
) -> ConfigError | None:
    """The error for fp8-family rules that served no matmul in a whole region, or None: a class
    rule no module took (``"nn.Linear=fp8"`` on a model without a Linear), or a rule whose
    modules ran and served nothing (``"norm=fp8"``: a LayerNorm has no matmul). ``ran`` and
    ``served``: the policy keys of the fp8-family rules that ran, and that served a matmul.

    Example:
        >>> from mixprec import Policy
        >>> net = nn.Sequential(nn.Conv1d(2, 2, 1))
        >>> print(check_class_reach(Policy("nn.Linear=fp8"), set(), set(), [net]))
        module rule nn.Linear=fp8 served no module in this region: ...

    Host sync: none.
    """
    classes = policy.class_rules.items()
    missing = [f"{class_label(t)}={r}" for t, r in classes if r.fp8_family and t not in ran]
    idle = [f"{class_label(t)}={r}" for t, r in classes if t in ran - served]
    idle += [f"{g}={r}" for g, r in policy.name_rules.items() if g in ran - served]
    models = ", ".join(type(r).__name__ for r in roots[:3])
    if missing:
        return ConfigError(
            f"module rule {', '.join(missing)} served no module in this region: the models run "
            f"here ({models}) hold no module of that class (fp8 serves {SERVES}). Drop the "
            "rule, name the modules it should serve, or pass Policy(..., strict=False) to allow it."
        )
    if idle:
        return ConfigError(
            f"module rule {', '.join(idle)} ran on modules of {models} that issued no matmul on "
            f"their weights in this region (fp8 serves {SERVES}). Name the modules it should "
            "serve, or pass Policy(..., strict=False) to allow it."
        )
    return None


def check_attention(root: nn.Module, plan_rules: dict[int, Any]) -> None:
    """Refuse an fp8 rule on the ``out_proj`` of an ``nn.MultiheadAttention`` without a rule:
    its forward never runs (the attention reads its weight), so the rule could not act (an
    attention with an fp8 rule is refused by its forward, one with another rule runs in that).

    Example:
        >>> check_attention(nn.Sequential(nn.MultiheadAttention(4, 1)), {})

    Raises:
        ConfigError: names the attention module and the fix.

    Host sync: none.
    """
    for n, m in root.named_modules():
        if not isinstance(m, nn.MultiheadAttention):
            continue
        own, proj = plan_rules.get(id(m)), plan_rules.get(id(m.out_proj))
        if proj is not None and proj.rule.fp8_family and own is None:
            raise ConfigError(attention_message(n))


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


def matmul_path(rule: str, device: torch.device | str, matmul: str | None = None) -> str:
    """Which path the matmuls of a Linear under an fp8-family ``rule`` take on ``device``:
    ``"hardware"`` (``torch._scaled_mm``, with block scales for the block recipes) or
    ``"emulated"`` (the casts' values dequantized to fp32 and an fp32 matmul, on every device).

    With ``matmul`` (``"fprop"``, ``"dgrad"`` or ``"wgrad"``), the path of that matmul alone:
    one of those two, or ``"high precision"`` for a matmul the rule runs in a 16- or 32-bit
    dtype (``"bf16/fp8/fp8"``'s fprop, ``"fp8:rowwise_gw_hp"``'s wgrad). A rule that gives its
    matmuls recipes of which the GPU runs some in hardware and not the others is refused here,
    as in a forward.

    The answer is for shapes the kernels take (multiples of 16); a matmul of other shapes is
    emulated, and :class:`~mixprec.Fp8Stats` says what ran (``path`` per module). The rule is read
    as a policy reads it; an output cast (``"fp8:rowwise@fp32"``) does not matter here.

    Example:
        >>> matmul_path("mxfp8", "cpu")
        'emulated'
        >>> matmul_path("bf16/mxfp8/nvfp4", "cpu", "fprop")
        'high precision'

    Raises:
        ConfigError: ``rule`` is not an fp8-family rule word, ``device`` is not a device,
            ``matmul`` is not one of the three, or the GPU runs some of the rule's recipes in
            hardware and not the others (names the matmuls and the compute capabilities).

    Host sync: none (a CUDA device's compute capability is read once per device).
    """
    try:
        parsed = Rule.coerce(rule)
    except ConfigError as err:
        raise ConfigError(f"matmul_path takes an fp8-family rule word: {err}") from None
    if not parsed.fp8_family or parsed.recipe is None:
        raise ConfigError(
            f"matmul_path takes an fp8-family rule word (such as 'fp8:rowwise', 'mxfp8', "
            f"'nvfp4', 'mxfp8/mxfp8/nvfp4'), got {rule!r}"
        )
    if matmul is not None and matmul not in MATMULS:
        raise ConfigError(f"matmul must be None or one of {', '.join(MATMULS)}, got {matmul!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"matmul_path: {device!r} is not a device ({err})") from None
    recipe = get_recipe(parsed.recipe)
    hardware = use_scaled_mm(dev, recipe)
    if matmul is not None and recipe.sources[MATMULS.index(matmul)] is None:
        return "high precision"
    return "hardware" if hardware else "emulated"
