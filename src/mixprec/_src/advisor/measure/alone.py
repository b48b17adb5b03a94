"""One module alone in a candidate, the rest of the model in float32: whole, or a recipe one
matmul at a time.

Measured whole (:func:`isolated`), the module runs in the candidate for one pass. Measured per
matmul (:func:`per_matmul`), a registry recipe gets two passes: fprop in it with dgrad and wgrad
in float32 (the module's input and output in the region's dtype, as the policy has them), then
an exact forward (fprop in float32, float32 around it) with dgrad and wgrad in it. With the
forward exact, dgrad's error reaches only the gradients upstream of the module and wgrad's only
the module's own weight gradient, so the second pass tells them apart by where the error landed;
the region's rounding of the module's input and output is counted once, in fprop's figure. A
module whose weight is tied to another module's (a head tied to the embedding) has upstream
gradients on its own weight too: its dgrad and wgrad get a pass each instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from mixprec._src.advisor.arguments import Candidate
from mixprec._src.advisor.measure.metrics import Power, ratio_to_db
from mixprec._src.advisor.measure.passes import Engine, Subject, Tap
from mixprec._src.advisor.report.advice import Measurement
from mixprec._src.autocast.region import autocast
from mixprec._src.fp8 import hook as fp8_hook
from mixprec._src.fp8.recipes import get_recipe
from mixprec._src.fp8.stats import Fp8Stats


def measure_alone(
    engine: Engine, subjects: Sequence[Subject], split: bool = False
) -> dict[str, list[Measurement]]:
    """Each subject alone in each candidate that serves it (a registry recipe per matmul with
    ``split``)."""
    return {s.name: [isolated(engine, s, c, split) for c in s.serving] for s in subjects}


def isolated(engine: Engine, subject: Subject, cand: Candidate, split: bool = False) -> Measurement:
    """Run ``subject`` alone in ``cand`` (the rest in float32) and compare with the reference;
    with ``split``, a registry recipe per matmul (:func:`per_matmul`)."""
    if split and cand.splits:
        return per_matmul(engine, subject, cand)
    stats = Fp8Stats() if cand.recipe is not None else None
    tap, grads = _run_alone(engine, subject, cand, stats)
    has_input_grads = subject.record.has_input_grad
    weight = engine.subset_power(grads, subject.param_index) if subject.param_index else None
    return Measurement(
        candidate=cand.word,
        model_grad_sqnr=engine.model_power(grads).sqnr,
        output_sqnr=tap.comparison.output.sqnr,
        input_grad_sqnr=tap.comparison.input_grad.sqnr if has_input_grads else None,
        weight_grad_sqnr=None if weight is None else weight.sqnr,
        fp8=None if stats is None else stats.read().get(subject.name),
    )


def passes_per(cand: Candidate, split: bool, tied: bool = False) -> int:
    """The passes :func:`isolated` runs for one module in ``cand`` (``tied``: the module's
    weight is another module's too). Host sync: none."""
    if not (split and cand.splits):
        return 1
    if not tied:
        return 2
    recipe = get_recipe(cand.recipe or "")
    return 1 + sum(a is not None for a, _ in recipe.pairs[1:])


def per_matmul(engine: Engine, subject: Subject, cand: Candidate) -> Measurement:
    """``cand``'s registry recipe one matmul at a time (the module docstring); the casts of
    every pass are recorded as the recipe's."""
    word, stats, exact = cand.word, Fp8Stats(), torch.float32
    forward = Candidate.of(f"{word}/fp32/fp32")
    tap_f, grads_f = _run_alone(engine, subject, forward, stats, cand.recipe, f"fprop in {word}")
    fprop = engine.model_power(grads_f).ratio
    own = subject.param_index
    if subject.tied:
        (dgrad, tap_b), (wgrad, grads_b) = _apart(engine, subject, cand, stats)
    else:
        backward = Candidate.of(f"fp32/{word}/{word}")
        text = f"dgrad, wgrad in {word}"
        tap_b, grads_b = _run_alone(engine, subject, backward, stats, cand.recipe, text, exact)
        whole = engine.model_power(grads_b)
        others = [i for i in range(len(engine.reference)) if i not in set(own)]
        dgrad = Power(whole.signal, engine.subset_power(grads_b, others).noise).ratio
        wgrad = Power(whole.signal, engine.subset_power(grads_b, own).noise).ratio
    has_input_grads = subject.record.has_input_grad
    weight = None if not own or grads_b is None else engine.subset_power(grads_b, own).sqnr
    return Measurement(
        candidate=word,
        model_grad_sqnr=ratio_to_db(fprop + dgrad + wgrad),
        output_sqnr=tap_f.comparison.output.sqnr,
        input_grad_sqnr=tap_b.comparison.input_grad.sqnr if has_input_grads and tap_b else None,
        weight_grad_sqnr=weight,
        fp8=stats.read().get(subject.name),
        matmuls=(ratio_to_db(fprop), ratio_to_db(dgrad), ratio_to_db(wgrad)),
    )


def _apart(
    engine: Engine, subject: Subject, cand: Candidate, stats: Fp8Stats
) -> tuple[tuple[float, Tap | None], tuple[float, list[torch.Tensor | None] | None]]:
    """A tied module's dgrad and wgrad, each alone with the forward exact: (dgrad's ratio and
    tap, wgrad's ratio and gradients); a matmul the recipe runs in high precision has no pass
    (no error: the forward is float32 around it)."""
    word, recipe = cand.word, get_recipe(cand.recipe or "")
    found: list[tuple[float, Tap | None, list[torch.Tensor | None] | None]] = []
    for i, (matmul, parts) in enumerate((("dgrad", "fp32/{w}/fp32"), ("wgrad", "fp32/fp32/{w}"))):
        if recipe.pairs[i + 1][0] is None:
            found.append((0.0, None, None))
            continue
        alone = Candidate.of(parts.format(w=word))
        text = f"{matmul} in {word}"
        tap, grads = _run_alone(engine, subject, alone, stats, cand.recipe, text, torch.float32)
        found.append((engine.model_power(grads).ratio, tap, grads))
    (dgrad, tap_d, _), (wgrad, _, grads_w) = found
    return (dgrad, tap_d), (wgrad, grads_w)


def _run_alone(
    engine: Engine,
    subject: Subject,
    cand: Candidate,
    stats: Fp8Stats | None,
    label: str | None = None,
    what: str | None = None,
    hp: torch.dtype | None = None,
) -> tuple[Tap, list[torch.Tensor | None]]:
    tap = Tap(subject.module, against=subject.record, scale=engine.scale)
    make = _alone_in(cand, subject, engine, stats, label, hp)
    text = f"{subject.name} {what or 'in ' + cand.word}"
    return tap, engine.run(text, [tap], isolate=(subject.module, make))


def _alone_in(
    cand: Candidate,
    subject: Subject,
    engine: Engine,
    stats: Fp8Stats | None,
    label: str | None = None,
    hp: torch.dtype | None = None,
) -> Callable[[], AbstractContextManager[Any]]:
    """A factory of the region ``subject`` runs in while the rest stays in float32. An fp8
    candidate runs the module's matmuls in fp8 with the region's dtype around them (as the
    policy will; ``hp`` instead, if given) and records the module's casts into ``stats`` under
    its name (and the recipe name ``label``, default its own)."""
    dtype, recipe, region = cand.dtype, cand.recipe, hp or engine.job.region
    if recipe is not None:
        assert stats is not None
        return lambda: _fp8_module(subject.module, subject.name, recipe, region, stats, label)
    assert dtype is not None
    device_type = engine.device_type
    return lambda: autocast(device_type, dtype=dtype)


@contextmanager
def _fp8_module(
    module: nn.Module, name: str, recipe: str, hp: torch.dtype, stats: Fp8Stats, label: str | None
) -> Iterator[None]:
    with stats:
        token = fp8_hook.enter_module(module, name, get_recipe(recipe), hp, label)
        try:
            yield
        finally:
            fp8_hook.exit_module(token)
