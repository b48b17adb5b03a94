"""How many of the measured modules' matmuls run in each format under the proposal.

A measured module with a Linear or conv GEMM runs three matmuls per step (fprop, dgrad, wgrad;
no dgrad when none of its inputs needed a gradient). Under the proposal each takes the format of
the module's rule for that matmul: a recipe's (``"fp8"``, ``"nvfp4"``, the parts of a rule per
matmul such as ``"nvfp4/nvfp4/bf16"``), a 16-bit dtype, or float32; a module without a rule (no
candidate serves it, or no candidate changes it) runs as the region runs it, in the region's
16-bit dtype. "Kept" counts modules, not matmuls: a module kept out of every candidate, all its
matmuls in the kept precision (float32, or the region's dtype around fp8).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mixprec._src.autocast.rules import Rule, format_dtype

if TYPE_CHECKING:
    from mixprec._src.advisor.report.advice import Advice, ModuleAdvice

_MATMULS = ("fprop", "dgrad", "wgrad")
_SIXTEEN = ("fp16", "bf16")


def module_formats(advice: Advice, m: ModuleAdvice) -> tuple[str, ...]:
    """The format of each matmul the module runs under the proposal (empty: no GEMM)."""
    if m.gemms is None:
        return ()
    region = format_dtype(advice.dtype)
    words = _words(m.choice) if m.served else (region,) * 3
    dgrad = any(m.gemms.input_grad)
    return tuple(w for w, name in zip(words, _MATMULS, strict=True) if dgrad or name != "dgrad")


def _words(choice: str) -> tuple[str, str, str]:
    matmuls = Rule(choice).matmuls
    if matmuls is None:  # a 16-bit dtype or float32
        return choice, choice, choice
    return matmuls[0], matmuls[1], matmuls[2]


def matmul_counts(advice: Advice) -> dict[str, int]:
    """Per format, the number of the measured modules' matmuls in it, the most first (ties by
    word). Host sync: none."""
    counts: dict[str, int] = {}
    for m in advice.modules:
        for word in module_formats(advice, m):
            counts[word] = counts.get(word, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def summary(advice: Advice) -> str:
    """The matmuls per format in words: ``27 (the measured modules' fprop, dgrad and wgrad):
    17 bf16, 10 nvfp4; 17 of 27 in 16-bit``."""
    counts = matmul_counts(advice)
    total = sum(counts.values())
    if not total:
        return "no Linear or conv matmul among the measured modules"
    sixteen = sum(counts.get(w, 0) for w in _SIXTEEN)
    each = ", ".join(f"{n} {w}" for w, n in counts.items())
    return (
        f"{total} (the measured modules' fprop, dgrad and wgrad): {each}; "
        f"{sixteen} of {total} in 16-bit"
    )
