"""Candidate precisions: what a rule word means to the advisor.

A candidate is a module rule word of :class:`mixprec.Policy` (``"fp16"``, ``"bf16"``, and the
fp8 recipes when the fp8 rule is available). For each one the advisor needs three things: which
modules it can serve, how to run one module in it while the rest of the model stays in float32
(the isolated pass), and the autocast region dtype a policy using it runs in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec._src.autocast.region import autocast
from mixprec._src.autocast.rules import Rule, format_dtype
from mixprec.errors import ConfigError

_16BIT = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Candidate:
    """One candidate precision: its rule word and, for 16-bit ones, its dtype."""

    word: str
    dtype: torch.dtype | None

    @property
    def is_fp16(self) -> bool:
        return self.dtype == torch.float16

    def serves(self, module: nn.Module) -> bool:
        """Whether this precision can be applied to ``module`` (16-bit: any module)."""
        return self.dtype is not None

    def isolated(
        self, device_type: str, region_dtype: torch.dtype
    ) -> Callable[[], AbstractContextManager[Any]]:
        """A factory of the region one module runs in while the rest stays in float32."""
        dtype = self.dtype
        assert dtype is not None

        def make() -> AbstractContextManager[Any]:
            return autocast(device_type, dtype=dtype)

        return make


def parse_candidates(words: Sequence[object] | str | None, device_type: str) -> list[Candidate]:
    """Validate candidate words (cheapest first); ``None`` is the device's autocast default.

    Raises:
        ConfigError: an empty list, a duplicate, or a word that is not a low-precision rule.
    """
    if words is None:
        words = ["bf16" if device_type == "cpu" else "fp16"]
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
    if rule.output is not None or not isinstance(rule.compute, torch.dtype):
        raise ConfigError(
            f"candidate {word!r} is not a low precision; candidates are 'fp16' or 'bf16' "
            "(the regions' dtypes), listed cheapest first"
        )
    return Candidate(str(rule), rule.compute if rule.compute in _16BIT else None)


def region_dtype(candidates: Sequence[Candidate]) -> torch.dtype:
    """The autocast dtype of the proposed region: the first 16-bit candidate, else bfloat16."""
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
