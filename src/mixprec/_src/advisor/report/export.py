"""The advice carried to another stack: torchao's ``convert_to_float8_training`` and torchtitan.

torchao.float8 converts ``nn.Linear`` modules to ``Float8Linear``, each call with one recipe
(``Float8LinearConfig.from_recipe_name``: ``"tensorwise"``, ``"rowwise"``,
``"rowwise_with_gw_hp"``) for the modules its ``module_filter_fn`` accepts. A module the advice
puts in one of those recipes is exported as one conversion per recipe; everything else is listed
with the reason torchao.float8 cannot run it: a rule per matmul (``"nvfp4/nvfp4/bf16"``), a
recipe it has no ``Float8LinearConfig`` for (``mxfp8``, ``nvfp4``, 128-blocks: torchao's
``MXLinear``/prototype paths, not ``convert_to_float8_training``), features that are not
multiples of 16 (what ``torch._scaled_mm`` needs). Kept modules and modules without a rule are
not converted: they run in the region's dtype, or in float32 under the stack's own autocast.

torchtitan (0.3) runs the whole advice through mixprec's converter (``MixprecConverter.Config``:
the policy string and the region's dtype); its own ``Float8LinearConverter`` expresses the
advice only when every converted module shares one rowwise recipe (its ``recipe_name`` takes
``"rowwise"`` or ``"rowwise_with_gw_hp"``) and its ``filter_fqns`` (modules left out by
substring of their name) leave out exactly the others.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from mixprec._src.autocast.rules import Rule, format_dtype
from mixprec._src.fp8.recipes import canonical

if TYPE_CHECKING:
    from mixprec._src.advisor.report.advice import Advice

#: mixprec's registry recipe -> torchao.float8's recipe name.
TORCHAO_RECIPES = {
    "tensorwise": "tensorwise",
    "rowwise": "rowwise",
    "rowwise_gw_hp": "rowwise_with_gw_hp",
}
_TITAN_RECIPES = ("rowwise", "rowwise_with_gw_hp")
_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def _float8() -> Any:
    """``torchao.float8``, imported on use: torchao is not a dependency of mixprec."""
    try:
        return importlib.import_module("torchao.float8")
    except ImportError as exc:
        raise ImportError(
            f"exporting the advice to torchao needs torchao.float8 ({exc}): pip install torchao"
        ) from exc


@dataclass(frozen=True)
class TorchaoConversion:
    """One call of ``torchao.float8.convert_to_float8_training``: a recipe and its modules.

    Attributes:
        recipe: torchao's recipe name (``Float8LinearConfig.from_recipe_name``).
        modules: the qualified names it converts.
    """

    recipe: str
    modules: tuple[str, ...]

    def config(self) -> Any:
        """``torchao.float8.Float8LinearConfig.from_recipe_name(recipe)`` (needs torchao).

        Host sync: none.
        """
        return _float8().Float8LinearConfig.from_recipe_name(self.recipe)

    def module_filter_fn(self, module: nn.Module, fqn: str) -> bool:
        """torchao's filter: True for the modules of this conversion. Host sync: none."""
        return fqn in self.modules


@dataclass(frozen=True)
class TorchaoExport:
    """The advice as torchao.float8 conversions and what they cannot express.

    Attributes:
        conversions: one per recipe, cheapest recipe first.
        not_expressible: ``(module, rule, why)`` for each ruled module torchao.float8 cannot run
            as advised.
    """

    conversions: tuple[TorchaoConversion, ...]
    not_expressible: tuple[tuple[str, str, str], ...]

    def apply(self, model: nn.Module) -> nn.Module:
        """Run ``convert_to_float8_training`` once per conversion on ``model`` (in place).

        Host sync: none.
        """
        convert = _float8().convert_to_float8_training
        for c in self.conversions:
            model = convert(model, config=c.config(), module_filter_fn=c.module_filter_fn)
        return model


@dataclass(frozen=True)
class TorchtitanExport:
    """The advice as torchtitan (0.3) converter configs.

    Attributes:
        mixprec: the fields of ``mixprec.integrations.torchtitan.MixprecConverter.Config``
            (the whole policy: every rule).
        float8: the fields of torchtitan's ``Float8LinearConverter.Config`` when it expresses
            the advice (one rowwise recipe, ``filter_fqns`` leaving out exactly the others);
            None when it does not (``not_expressible`` says why).
        not_expressible: ``(module, rule, why)`` for what ``float8`` cannot express.
    """

    mixprec: Mapping[str, Any]
    float8: Mapping[str, Any] | None
    not_expressible: tuple[tuple[str, str, str], ...]


def _per_matmul(rule: Rule) -> bool:
    return rule.matmuls is not None and len(set(rule.matmuls)) > 1


def _why_not(word: str, kind: str, dims: tuple[int, int] | None) -> str | None:
    """Why torchao.float8 cannot run ``word`` on the module; None when it can."""
    rule = Rule(word)
    if _per_matmul(rule):
        return "a rule per matmul: torchao.float8 gives a module's three matmuls one recipe"
    recipe = canonical(rule.recipe or "")
    if recipe not in TORCHAO_RECIPES:
        return f"{word}: torchao.float8 has no Float8LinearConfig recipe for it"
    if kind != "Linear":
        return f"a {kind}: convert_to_float8_training converts nn.Linear"
    if dims is not None and (dims[0] % 16 or dims[1] % 16):
        return f"features {dims[0]} x {dims[1]}: torch._scaled_mm needs multiples of 16"
    return None


def _recipe_words(advice: Advice) -> list[tuple[str, str, str | None]]:
    """(module, rule word, torchao recipe or None) for every module the advice puts in a
    recipe; ``not_expressible`` reasons come from :func:`_why_not`."""
    out = []
    for m in advice.modules:
        if not m.served or m.choice == advice.kept_precision:
            continue
        rule = Rule(m.choice)
        if rule.recipe is None:
            continue  # a 16-bit or float32 module: the stack's autocast runs it
        out.append((m.name, m.choice, None if _per_matmul(rule) else canonical(rule.recipe)))
    return out


def to_torchao(advice: Advice, dims: Callable[[str], tuple[int, int] | None]) -> TorchaoExport:
    """The torchao.float8 conversions of ``advice``; ``dims(name)``: a module's features."""
    kinds = {m.name: m.kind for m in advice.modules}
    groups: dict[str, list[str]] = {}
    refused = []
    for name, word, recipe in _recipe_words(advice):
        why = _why_not(word, kinds[name], dims(name))
        if why is not None:
            refused.append((name, word, why))
            continue
        groups.setdefault(TORCHAO_RECIPES[recipe or ""], []).append(name)
    order = list(TORCHAO_RECIPES.values())
    conversions = tuple(
        TorchaoConversion(r, tuple(groups[r])) for r in sorted(groups, key=order.index)
    )
    return TorchaoExport(conversions, tuple(refused))


def to_torchtitan(advice: Advice, names: list[str], ao: TorchaoExport) -> TorchtitanExport:
    """torchtitan's configs for ``advice``; ``names``: every ``nn.Linear``'s qualified name in
    the model (what ``filter_fqns`` must leave out)."""
    dtype = _TORCH_DTYPES.get(format_dtype(advice.dtype), "bfloat16")
    mixprec = {"policy": str(advice.policy), "dtype": dtype}
    refused = list(ao.not_expressible)
    titan = [c for c in ao.conversions if c.recipe in _TITAN_RECIPES]
    for c in ao.conversions:
        if c.recipe not in _TITAN_RECIPES:
            why = f"{c.recipe}: torchtitan's Float8LinearConverter takes rowwise recipes only"
            refused += [(n, c.recipe, why) for n in c.modules]
    if len(titan) > 1:
        why = "torchtitan's Float8LinearConverter takes one recipe for the whole model"
        refused += [(n, c.recipe, why) for c in titan[1:] for n in c.modules]
    if not titan or refused:
        return TorchtitanExport(mixprec, None, tuple(refused))
    converted = set(titan[0].modules)
    left_out = [n for n in names if n not in converted]
    hit = [n for n in converted if any(f in n for f in left_out)]
    if hit:
        why = "filter_fqns leaves modules out by substring: this name contains a left-out one"
        return TorchtitanExport(mixprec, None, tuple((n, titan[0].recipe, why) for n in hit))
    float8 = {"recipe_name": titan[0].recipe, "filter_fqns": left_out}
    return TorchtitanExport(mixprec, float8, ())
