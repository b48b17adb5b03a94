"""Candidate precisions: what a rule word means to the advisor.

A candidate is a module rule word of :class:`mixprec.Policy`: ``"fp16"``, ``"bf16"``, or any
word of a recipe in the fp8 registry (``"fp8"``, ``"fp8:rowwise"``, ...): a rule whose compute
word takes a recipe. For each one the advisor needs three things: which
modules it can serve, how to run one module in it while the rest of the model stays in float32
(the isolated pass), and the autocast region dtype a policy using it runs in.

An fp8 candidate runs the module's own matmuls on fp8 operands through the fp8 package's module
hook, with the region's dtype around them (their results are rounded to it, as under the
policy), and records the module's fp8 cast statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec._src.autocast.region import autocast
from mixprec._src.autocast.rules import Rule, format_dtype
from mixprec._src.fp8 import hook as fp8_hook
from mixprec._src.fp8.recipes import RECIPES, get_recipe
from mixprec._src.fp8.stats import Fp8Stats
from mixprec.errors import ConfigError

_16BIT = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Candidate:
    """One candidate precision: its rule word, and its dtype (16-bit) or fp8 recipe."""

    word: str
    dtype: torch.dtype | None
    recipe: str | None = None

    @staticmethod
    def of(word: object) -> Candidate:
        """The candidate a rule word names. Raises ConfigError for another word."""
        return _parse_one(word)

    @property
    def is_fp16(self) -> bool:
        return self.dtype == torch.float16

    def serves(self, module: nn.Module) -> bool:
        """Whether this precision can be applied to ``module`` (16-bit: any module; a recipe:
        an ``nn.Linear`` whose features its blocks tile)."""
        return self.why_not(module) is None

    def why_not(self, module: nn.Module) -> str | None:
        """Why this precision cannot serve ``module``, None where it can."""
        if self.recipe is None:
            return None
        weight = getattr(module, "weight", None)
        if not fp8_hook.can_serve(type(module)) or not isinstance(weight, torch.Tensor):
            return f"{self.word} serves {fp8_hook.SERVES}"
        _, k, n = get_recipe(self.recipe).multiples()
        if weight.dim() != 2:
            return f"{self.word} serves 2D weights"
        out_features, in_features = weight.shape
        if in_features % k:
            return f"in_features {in_features} is not a multiple of {self.word}'s block {k}"
        if out_features % n:
            return f"out_features {out_features} is not a multiple of {self.word}'s block {n}"
        return None

    def isolated(
        self,
        module: nn.Module,
        name: str,
        device_type: str,
        region: torch.dtype,
        stats: Fp8Stats | None,
    ) -> Callable[[], AbstractContextManager[Any]]:
        """A factory of the region ``module`` runs in while the rest stays in float32. An fp8
        candidate runs the module's matmuls in fp8 with the region's dtype around them (as the
        policy will) and records the module's casts into ``stats`` under ``name``."""
        dtype, recipe = self.dtype, self.recipe
        if recipe is not None:
            assert stats is not None
            return lambda: _fp8_module(module, name, recipe, region, stats)
        assert dtype is not None
        return lambda: autocast(device_type, dtype=dtype)


@contextmanager
def _fp8_module(
    module: nn.Module, name: str, recipe: str, hp: torch.dtype, stats: Fp8Stats
) -> Iterator[None]:
    with stats:
        token = fp8_hook.enter_module(module, name, get_recipe(recipe), hp)
        try:
            yield
        finally:
            fp8_hook.exit_module(token)


def _default_word(device_type: str) -> str:
    """The word of torch's autocast dtype for the device type (as ``mixprec.autocast``)."""
    try:
        default = torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type without autocast: the region's own error comes later
        return "fp16"
    return "bf16" if default == torch.bfloat16 else "fp16"


def parse_candidates(words: Sequence[object] | str | None, device_type: str) -> list[Candidate]:
    """Validate candidate words (cheapest first); ``None`` is the device's autocast default.

    Raises:
        ConfigError: an empty list, a duplicate, or a word that is not a low-precision rule.
    """
    if words is None:
        words = [_default_word(device_type)]
    elif isinstance(words, str):
        words = [w for w in words.replace(" ", "").split(",") if w]
    if not words:
        raise ConfigError("candidates is empty; pass e.g. candidates=['fp16'] or ['bf16']")
    out: list[Candidate] = []
    for word in words:
        cand = _parse_one(word)
        if any(c.word == cand.word for c in out):
            raise ConfigError(f"candidate {cand.word!r} is listed twice in {list(words)!r}")
        out.append(cand)
    return out


def _parse_one(word: object) -> Candidate:
    if isinstance(word, torch.dtype):
        word = format_dtype(word)
    if not isinstance(word, str):
        raise ConfigError(
            f"candidate {word!r} has type {type(word).__name__}; candidates are rule words "
            "such as 'fp16' or 'bf16'"
        )
    rule = Rule(word)  # raises ConfigError listing the accepted words
    if rule.output is None and isinstance(rule.compute, str) and rule.recipe is not None:
        return Candidate(str(rule), None, rule.recipe)  # a recipe of the fp8 registry
    if rule.output is not None or rule.compute not in _16BIT:
        recipes = ", ".join(f"'fp8:{name}'" for name in RECIPES)
        raise ConfigError(
            f"candidate {word!r} is not a low precision; candidates are 'fp16', 'bf16' (the "
            f"regions' dtypes) or the fp8 registry's recipe words ('fp8', {recipes}, ...), "
            "listed cheapest first"
        )
    assert isinstance(rule.compute, torch.dtype)
    return Candidate(str(rule), rule.compute)


def region_dtype(candidates: Sequence[Candidate]) -> torch.dtype:
    """The autocast dtype of the proposed region: the first 16-bit candidate, else bfloat16
    (fp8 matmuls run inside a 16-bit region)."""
    for cand in candidates:
        if cand.dtype is not None:
            return cand.dtype
    return torch.bfloat16


def high_word(candidates: Sequence[Candidate], region: torch.dtype) -> str:
    """What a module kept out of every candidate runs in: float32 if the region's dtype is a
    candidate, else the region's dtype (e.g. bf16 when the candidates are fp8 recipes)."""
    if any(c.dtype == region for c in candidates):
        return "fp32"
    return format_dtype(region)


def unserved_reason(candidates: Sequence[Candidate], module: nn.Module) -> str:
    """Why no candidate serves ``module``: each candidate's reason, the same ones once."""
    reasons = [r for c in candidates if (r := c.why_not(module)) is not None]
    return "; ".join(dict.fromkeys(reasons))


def check_served(cands: Sequence[Candidate], chosen: Sequence[tuple[str, nn.Module]]) -> None:
    """Every candidate must serve at least one measured module.

    Raises:
        ConfigError: one serves none; the message says why for the first few modules.
    """
    for cand in cands:
        if any(cand.serves(m) for _, m in chosen):
            continue
        shown = [f"{n} ({type(m).__name__}: {cand.why_not(m)})" for n, m in chosen[:4]]
        more = f" and {len(chosen) - 4} more" if len(chosen) > 4 else ""
        raise ConfigError(
            f"candidate {cand.word!r} serves none of the measured modules: "
            f"{', '.join(shown)}{more}; measure other modules (modules=[...]) or drop it"
        )
